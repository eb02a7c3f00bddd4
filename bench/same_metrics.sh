#!/bin/bash
# Runs a set of short CPU jobs (both default jobs, and tiny-model runs covering every loss and estimator feature)
# from the checkout REPO into OUTROOT/<name>/metrics.jsonl, to compare two versions of the loop seed for seed:
#   bash bench/same_metrics.sh /path/to/old/checkout /tmp/before && bash bench/same_metrics.sh . /tmp/after
#   python bench/compare_metrics.py /tmp/before /tmp/after
# TINY_MODEL / TINY_RM: a tiny random Llama and reward model (bench/same_metrics_models.py writes them).
usage="usage: same_metrics.sh REPO OUTROOT [names...]"
REPO=${1:?$usage}; OUT=${2:?$usage}; shift 2
: "${TINY_MODEL:=/tmp/rft_tiny/model}" "${TINY_RM:=/tmp/rft_tiny/rm}" "${CHARS:=/tmp/rft_tiny/chars.py}" "${PTX:=/tmp/rft_tiny/ptx.jsonl}"
T="--pretrain $TINY_MODEL --max_steps 3 --rollout_batch_size 2 --n_samples_per_prompt 2 --micro_train_batch_size 2 --micro_rollout_batch_size 4 --generate_max_len 8 --reward_fn $CHARS:chars --actor_learning_rate 1e-3"
VLT="--max_steps 3 --rollout_batch_size 2 --n_samples_per_prompt 4 --micro_train_batch_size 4 --generate_max_len 4"
declare -A C
C[text_default]="train_ppo.py --max_steps 3"
C[vl_default]="train_ppo_vl.py --max_steps 6"
C[gae]="train_ppo.py $T --advantage_estimator gae --freezing_actor_steps 1 --kl_target 0.01 --init_kl_coef 0.1"
C[cpgd]="train_ppo.py $T --advantage_estimator cpgd --reward_pretrain $TINY_RM --reward_weights 1 0.5 --reward_clip 3 --normalize_reward --dynamic_sampling --high_entropy_token_ratio 0.2 --overlong_buffer_len 4 --ema_beta 0.9 --pretrain_data $PTX --train_batch_size 2"
C[rloo_kl]="train_ppo.py $T --advantage_estimator rloo --loss_agg_mode seq-mean-token-mean --use_kl_loss --kl_estimator k2 --max_epochs 2 --train_batch_size 2"
C[variants]="train_ppo.py $T --eps_clip_low_high 0.2 0.28 --dual_clip 3 --use_gspo --loss_agg_mode seq-mean-token-mean --tis_cap 2 --train_batch_size 2 --entropy_coef 0.01"
C[lora]="train_ppo.py $T --lora_rank 4 --advantage_estimator reinforce --actor_learning_rate 1e-2"
C[vl_gae]="train_ppo_vl.py $VLT --advantage_estimator gae --freezing_actor_steps 1 --critic_learning_rate 1e-3 --reward_fn $CHARS:chars"
C[vl_kl]="train_ppo_vl.py $VLT --advantage_estimator reinforce_baseline --use_kl_loss --high_entropy_token_ratio 0.5 --entropy_coef 0.01"
names="$@"; [ -z "$names" ] && names="${!C[@]}"
cd $REPO
for n in $names; do
  rm -rf $OUT/$n; mkdir -p $OUT/$n
  OMP_NUM_THREADS=1 python ${C[$n]} --output_dir $OUT/$n > $OUT/$n/log.txt 2>&1; echo "$n rc=$?"
done
