# Sourced by bench/gpu_check.sh and bench/gpu_quick.sh: start the random-weights Flash x4 server in
# the background (its log in $OUT/server.log, its pid in $server) and wait until /health answers,
# the server dies, or TRIES x 2 s pass.
#   start_random_server MAX_NUM_SEQS TRIES [MAX_MODEL_LEN (4096)]
start_random_server() {
  python3 bench/serve_random.py --preset flash --layers 4 --format fp8-mxfp4 --max-num-seqs "$1" --max-model-len "${3:-4096}" \
    --port 8000 > "$OUT/server.log" 2>&1 &
  server=$!
  for _ in $(seq "$2"); do
    python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:8000/health').status_code!=200)" 2>/dev/null && break
    kill -0 $server 2>/dev/null || break
    sleep 2
  done
}
