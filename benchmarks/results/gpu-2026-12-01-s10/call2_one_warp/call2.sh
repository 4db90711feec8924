bash benchmarks/gpu_session.sh engine_decode_kernels
BEST=$(cat /tmp/podium_best_engine_decode_env 2>/dev/null)
echo "BEST=$BEST"
W=/tmp/w; mkdir -p $W
for i in 1 2; do
  TAIL=4 OUT=$W/a$i bash benchmarks/gpu_session.sh tp_8b_fp8 | grep -E "==|Output tok"
  TAIL=4 OUT=$W/b$i AB_ENV="PODIUM_CUDA_TUNING=$BEST" bash benchmarks/gpu_session.sh tp_8b_fp8_B | grep -E "==|Output tok"
  TAIL=4 OUT=$W/c$i AB_ENV="PODIUM_CUDA_TUNING=$BEST,mixed_decode_min=32" bash benchmarks/gpu_session.sh tp_8b_fp8_B | grep -E "==|Output tok"
done
TAIL=30 OUT=$W/p AB_ENV="PODIUM_CUDA_TUNING=$BEST,mixed_decode_min=32" bash benchmarks/gpu_session.sh step_profile_8b_fp8_B | head -8
OUT=$OUT bash benchmarks/gpu_session.sh triton_cache_out
tar czf $OUT/ab.tar.gz -C $W .
