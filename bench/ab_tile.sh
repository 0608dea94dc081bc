python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1; mkdir -p /tmp/pkg && ln -sfn $PWD /tmp/pkg/mxserve; export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1
run() { # $1 = TILE_ROWS, $2 = script, rest = args
  t=$1; shift; s=$1; shift
  python3 -c "import sys; sys.path.insert(0, 'bench'); from mxserve.kernels import mx_linear; mx_linear.TILE_ROWS = $t; sys.argv = ['$s'] + sys.argv[1:]; import runpy; runpy.run_path('bench/$s', run_name='__main__')" "$@"
}
for t in 0 64; do
  run $t mx_decode_probe.py --shapes 14336x4096,4096x14336,28672x8192,16384x2048 --fmts e2m1 --ms 1,16 --past-l2 --no-load-probe --variants n128s3p4,n64s3p4,n64s3p8 --budget 100 --out $OUT/fp4_t$t.json > $OUT/fp4_t$t.log 2>&1
  run $t mx_decode_probe.py --shapes 14336x4096,4096x14336,28672x8192,16384x2048 --fmts e2m3 --ms 1,16 --past-l2 --no-load-probe --variants n64s3p2,n64s3p8 --budget 100 --out $OUT/fp6_t$t.json > $OUT/fp6_t$t.log 2>&1
  mkdir -p $OUT/eng_t$t; run $t engine_gpu.py --shapes llama-3.2-1b,llama-3-8b --sections batch1,mx --out $OUT/eng_t$t > $OUT/eng_t$t.log 2>&1
  tail -1 $OUT/fp4_t$t.log; tail -1 $OUT/fp6_t$t.log; grep "batch1 |" $OUT/eng_t$t/engine_gpu.md
done
