cd /work/main
C="--root /tmp/pcpu --steps 10 --max_len 128 --staleness 1 --warm_steps 6 --skip 2 --timeout 3000"
H="-- --engine_type hf --rollout_batch_size 8 --n_samples_per_prompt 4 --eval_steps 100"
export OUT=/tmp/pcpu/out
python bench/bench_partial.py $C --seeds 0 --tag delay1 --modes partial --budget 127 --arm_flags "--partial_order start" $H
python bench/bench_partial.py $C --seeds 0 --tag lag1 --engine_lag 1 --modes sync_tis $H
python bench/bench_partial.py $C --seeds 1 --tag delay1 --modes partial --budget 127 --arm_flags "--partial_order start" $H
python bench/bench_partial.py $C --seeds 1 --tag lag1 --engine_lag 1 --modes sync_tis $H
