# call 3: the new defaults (fp8 decode 16/32/1/3, new token first, mixed split at 32) proven and timed
bash benchmarks/gpu_session.sh engine_tests decode_tests engine_decode_kernels
W=/tmp/w; mkdir -p $W
TAIL=4 OUT=$W/a1 bash benchmarks/gpu_session.sh tp_8b_fp8 tp_8b | grep -E "==|Output tok"
TAIL=4 OUT=$W/b1 AB_ENV="PODIUM_CUDA_TUNING=fp8_decode=none,decode_new_token_first=0,mixed_decode_min=0" \
  bash benchmarks/gpu_session.sh tp_8b_fp8_B | grep -E "==|Output tok"
TAIL=4 OUT=$W/a2 bash benchmarks/gpu_session.sh tp_8b_fp8 | grep -E "==|Output tok"
OUT=$OUT bash benchmarks/gpu_session.sh triton_cache_out
tar czf $OUT/ab.tar.gz -C $W .
