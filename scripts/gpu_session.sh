#!/usr/bin/env bash
# The GPU work as one sequence of stages, for the GPU machine (../shared/device/README.md: 30
# minutes of device time a session, the machine handed back after ~30 s idle, /tmp kept between
# runs that follow each other). Run from the repository root there, after onnxruntime-gpu is
# installed into /tmp/ortgpu (the wheel pruned to sm_90 by scripts/prune_ort_gpu.py: two runs; with
# pytest: ORT_GPU_EXTRA="pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0" for
# prepare-ort-gpu.sh, and the onnx-ad wheel copied into .ortgpu-install/), the bench wheels copied to
# /tmp/bw and onnxcampo installed into /tmp/oc (docs/benchmarks/README.md, "Preparing" and "Running"):
#
#   bash scripts/gpu_session.sh STAGE [STAGE ...]      results under $OUT/<stage>/
#
# The benchmarks run as `python3 -P -m onnxcampo.benchmarks SUBCOMMAND` (-P: the installed
# /tmp/oc copy, not the checkout's ./onnxcampo folder, which lacks the mapped subpackages).
#
# Stages (each under its own time limit; a failed stage does not stop the next; its exit status
# and command are appended to $OUT/<stage>/rc):
#   checks   the GPU tests (tests/gpu, docs/guide/contributing.md) but the end-to-end ones: every
#            custom op's CUDA kernels against their CPU kernels and numpy references, the
#            side-by-side timings (figures as JSON in $OUT/checks/<test module>.json), the Trainer
#            on the device. CHECKS (pytest's arguments) narrows them, e.g. to the modules a cut
#            run did not reach; CHECKS_LIMIT_S (default 590) bounds them                   (~7 min)
#   cudnn    the NHWC convolutions with each cuDNN API (ONNXCAMPO_CUDNN_API=legacy, the default, and
#            graph): tests/gpu/test_conv_nhwc_cuda.py (numbers against numpy both ways; host time
#            per call; ResNet-50 b64's forward convolutions run node by node with each API beside
#            ORT's NCHW Conv, figures in $OUT/cudnn/), then `costdb calibrate` resumed on a copy of
#            this GPU's shipped samples with the graph API: the host classes they lack
#            (conv_nhwc_graph, conv_fp16) measured, $OUT/cudnn/<gpu>.json and .jsonl to ship (~4 min)
#   policies every policy end to end on CUDA (tests/gpu/test_policies_cuda.py: the MLP block,
#            BERT-base and GPT-2 exported there), figures in $OUT/policies/               (~5 min)
#   calibrate  this GPU's cost database by `onnxcampo costdb calibrate` (timed), written as
#            $OUT/calibrate/<gpu>.json with its samples beside it; copy both to costdb/data/ and
#            costdb/data/raw/ to ship it; CALIBRATE_BUDGET_S (default 540); to resume, carry the
#            samples back and set CALIBRATE_SAMPLES to them                                  (~8 min)
#   defaults inference with default options (campo-auto: the rewrites by predicted cost) against the anchors (fp32, ORT's fp16 converter, ORT's
#            transformers optimizer + fp16, ModelOpt), plain and replayed, on BERT, GPT-2,
#            ResNet-50, the odd MLP and three corpus models (BENCH_MODELS narrows them)        (~10 min)
#   profile  per-kernel and per-node times of several variants of one model (the benchmarks'
#            profile-variants), with each variant's predicted time and rewrite decisions;
#            PROFILE_CASES="model:batch:policy,policy ..." (default: BERT b32, GPT-2 b8, ResNet-50 b64,
#            the anchors against campo's defaults), JSON in $OUT/profile/              (~4 min)
#   costs    FusedElementwise's bandwidth fit for the cost database, and the database's grid
#            cases with no sample (costdb/data/raw/harvested-cases.json); copy
#            $OUT/costs/nvidia-h200.jsonl over costdb/data/raw/ and refit (`onnxcampo costdb fit
#            costdb/data/raw/nvidia-h200.jsonl costdb/data/nvidia-h200.json`)          (~2 min)
#   bench    training steps: campo with both fusions (channels-last too for ResNet-50:
#            campo-/fp16-fused-cl-graph), the fp16 plan with
#            both fusions, greedy amp, torch.compile (ResNet-50's AMP also channels_last);
#            BERT, GPT-2, ResNet-50 (BENCH_BUDGET_S a model group, default 300; BENCH_MODELS,
#            BENCH_POLICIES narrow them)                                                  (~9 min)
#   rotate   training steps of one model side by side, in rotation, in one process
#            (the benchmarks' rotate; ROTATE_MODEL, default resnet50, ROTATE_POLICIES,
#            ROTATE_ROUNDS, ROTATE_SPLIT): campo NCHW and channels-last with and without the
#            BatchNorm sums in one pass (batchnorm_sums), torch.compile AMP channels_last replayed
#            (reduce-overhead), CUPTI splits of campo's and torch's; the loss read every 10
#            steps on both sides                                                         (~4 min)
#   targets  the training targets in three rotations (the benchmarks' rotate, one process a
#            model, the loss read every 10 steps on both sides): campo with every fusion
#            (ResNet-50 NCHW and channels-last; channels-last with means_end_deny too) against the fp16 plan with them and
#            torch.compile replayed (reduce-overhead; AMP, channels_last for ResNet-50), the fp32
#            step with the fusions against torch.compile fp32; the transformers also against
#            greedy amp; ROTATE_ROUNDS (default 5)                                         (~8 min)
#   loss     200-step loss curves against fp32 (the benchmarks' loss-curves; run again until it
#            stops printing "variants left")                                              (~9 min)
#   infer    inference with the fusions: campo with both fusions against campo
#            and the best anchors, plain and replayed, on the transformer and CNN suite (BENCH_MODELS,
#            BENCH_POLICIES: e.g. resnet50 with campo-fused-cl-graph, the convolutions channels-last)
#                                                                                         (~8 min)
#   finetune the fine-tuning example on CUDA (magika, frozen and --train-all); carry
#            .benchcorpus/magika-1.0.3 (CORPUS_DIR, default .benchcorpus)                  (~2 min)
# bench and infer re-measure rows older than BENCH_SINCE (default: now); a stage its budget cut
# continues in the next call with the same BENCH_SINCE (e.g. BENCH_SINCE=2026-12-02T10:00), after
# the rows that came back are merged into docs/benchmarks/raw/.
# Copy what comes back into the repository before the next run (the machine keeps nothing):
# $OUT/checks/*.json -> docs/benchmarks/custom-ops/, $OUT/policies/*.json -> docs/benchmarks/gpu-check/,
# $OUT/bench/h200*.jsonl merged into docs/benchmarks/raw/, $OUT/loss/loss-curves-h200.json and
# $OUT/finetune/* -> docs/benchmarks/training/.
set -uo pipefail
: "${OUT:?set OUT to the folder that comes back}"
export PYTHONPATH=/tmp/ortgpu:/tmp/oc:/tmp/benchpkgs:${PYTHONPATH:-}
export ONNXCAMPO_OPS_LIBRARY=${ONNXCAMPO_OPS_LIBRARY:-$PWD/onnxcampo/ops/lib/libonnxcampo_ops.so}
export ONNXCAMPO_KERNEL_CACHE=${ONNXCAMPO_KERNEL_CACHE:-/tmp/onnxcampo-kernels}
WHEELS=${WHEELS:-/tmp/bw}
# onnx-ad (a dependency the image lacks; onnxcampo is installed there with --no-deps) from the bench wheels
python3 -c "import onnx_ad" 2>/dev/null || python3 -m pip install -q --no-deps --no-index --target /tmp/oc "$WHEELS"/onnx_ad-*.whl

stage() {  # stage NAME LIMIT_S COMMAND...: runs COMMAND with its output in $OUT/NAME/log
  local name=$1 limit=$2
  shift 2
  mkdir -p "$OUT/$name"
  echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/$name/log"
  timeout "$limit" "$@" >>"$OUT/$name/log" 2>&1
  local rc=$?
  echo "$rc $*" >>"$OUT/$name/rc"
  echo "== $name rc $rc" | tee -a "$OUT/$name/log"
  tail -n 4 "$OUT/$name/log"
}

run_checks() {
  # -P: the installed onnxcampo (/tmp/oc), not the checkout's folder (which lacks onnxcampo.costdb);
  # ONNXCAMPO_GPU_REQUIRED: a missing CUDA provider or kernel fails the tests instead of skipping them
  ONNXCAMPO_GPU_RESULTS=$OUT/checks ONNXCAMPO_GPU_REQUIRED=1 stage checks "${CHECKS_LIMIT_S:-590}" python3 -P -m pytest -m gpu -q \
    ${CHECKS:-tests/gpu --ignore=tests/gpu/test_policies_cuda.py}
}

run_cudnn() {
  ONNXCAMPO_GPU_RESULTS=$OUT/cudnn ONNXCAMPO_GPU_REQUIRED=1 stage cudnn 420 python3 -P -m pytest -m gpu -q \
    tests/gpu/test_conv_nhwc_cuda.py -k "cudnn_api or host_time or match_numpy or matches_numpy"
  local gpu samples
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1 | tr 'A-Z' 'a-z' | sed -E 's/[^a-z0-9]+/-/g; s/^-|-$//g')
  samples=costdb/data/raw/$gpu.jsonl
  [ -f "$samples" ] || return 0
  cp "$samples" "$OUT/cudnn/$gpu.jsonl"
  # resumed: the host classes the samples lack (conv_nhwc_graph under the graph API, conv_fp16)
  ONNXCAMPO_CUDNN_API=graph stage cudnn 200 python3 -P -m onnxcampo costdb calibrate --out "$OUT/cudnn/$gpu.json" --budget-s 150
  grep '"kind": "host"' "$OUT/cudnn/$gpu.jsonl" | tee -a "$OUT/cudnn/log"
}

run_policies() {
  ONNXCAMPO_GPU_RESULTS=$OUT/policies ONNXCAMPO_GPU_REQUIRED=1 stage policies 590 python3 -P -m pytest -m gpu -q \
    tests/gpu/test_policies_cuda.py
}

run_calibrate() {
  local gpu db
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1 | tr 'A-Z' 'a-z' | sed -E 's/[^a-z0-9]+/-/g; s/^-|-$//g')
  db=$OUT/calibrate/$gpu.json
  mkdir -p "$OUT/calibrate"
  [ -n "${CALIBRATE_SAMPLES:-}" ] && cp "$CALIBRATE_SAMPLES" "${db%.json}.jsonl"
  stage calibrate 590 bash -c "time python3 -P -m onnxcampo costdb calibrate --out $db --budget-s ${CALIBRATE_BUDGET_S:-540}"
  # the later stages' optimize picks it up where a user's would (the per-user cache)
  local cached
  cached=$(python3 -P -m onnxcampo costdb calibrate --where | cut -d' ' -f1)
  [ -f "$db" ] && mkdir -p "$(dirname "$cached")" && cp "$db" "$cached"
}

run_defaults() {
  stage defaults 590 python3 -P -m onnxcampo.benchmarks run --out /tmp/benchraw --name "${BENCH_NAME:-h100}" --wheels "$WHEELS" \
    --mirror "$OUT/defaults" --corpus-dir "${CORPUS_DIR:-.benchcorpus}" --budget-s "${BENCH_BUDGET_S:-520}" \
    --models "${BENCH_MODELS:-resnet50,bert,gpt2,odd_mlp,ppocr_det,ppocr_rec,magika}" --mode inference \
    --policies "${BENCH_POLICIES:-fp32,fp32-graph,fp16-graph,ort-fp16,ortopt-fp16,modelopt,campo-auto,campo-auto-graph}"
}

run_profile() {
  # PROFILE_CASES: "model:batch:policy,policy ..." (space-separated cases)
  local cases=${PROFILE_CASES:-"bert:32:ortopt-fp16,campo-auto,campo-auto-rawmask,fp16 gpt2:8:ortopt-fp16,campo-auto,fp16 resnet50:64:ort-fp16,fp16,campo-auto,campo-fused-cl"}
  local case model batch policies
  for case in $cases; do
    IFS=: read -r model batch policies <<<"$case"
    stage profile 300 python3 -P -m onnxcampo.benchmarks profile-variants --model "$model" --batch "$batch" \
      --policies "$policies" --wheels "$WHEELS" --out "$OUT/profile/$model-b$batch.json"
  done
}

run_costs() {
  stage costs 120 python3 -P -m onnxcampo.benchmarks fused-elementwise-costs --out "$OUT/costs/fused_elementwise_costs.json"
  # the cost database's grid cases not measured yet (the samples file resumes: only those run)
  cp costdb/data/raw/nvidia-h200.jsonl "$OUT/costs/nvidia-h200.jsonl"
  # -P: the checkout (cwd) is not on the path, the installed onnxcampo is (the checkout has no onnxcampo.costdb)
  stage costs 300 python3 -P -m onnxcampo costdb measure --out "$OUT/costs/nvidia-h200.jsonl" --budget-s 240
}

run_bench() {
  # the transformers without the channels-last variants (no convolution: each would be planned only
  # to be refused), ResNet-50 with them; BENCH_MODELS narrows the models
  local models=${BENCH_MODELS:-bert,gpt2,resnet50} common="campo-fused-graph,fp16-fused-graph,amp-graph,torch-compile,torch-compile-amp"
  local text image
  text=$(echo "$models" | tr ',' '\n' | grep -v '^resnet50$' | paste -sd, -)
  image=$(echo "$models" | tr ',' '\n' | grep '^resnet50$' | paste -sd, -)
  local since=${BENCH_SINCE:-$(date -u +%Y-%m-%dT%H:%M)}
  [ -n "$text" ] && stage bench 590 python3 -P -m onnxcampo.benchmarks run --out docs/benchmarks/raw --wheels "$WHEELS" --mirror "$OUT/bench" \
    --budget-s "${BENCH_BUDGET_S:-300}" --models "$text" --mode training --policies "${BENCH_POLICIES:-$common}" \
    --redo '*|*|training|*' --redo-before "$since"
  [ -n "$image" ] && stage bench 590 python3 -P -m onnxcampo.benchmarks run --out docs/benchmarks/raw --wheels "$WHEELS" --mirror "$OUT/bench" \
    --budget-s "${BENCH_BUDGET_S:-300}" --models "$image" --mode training \
    --policies "${BENCH_POLICIES:-$common,campo-fused-cl-graph,fp16-fused-cl-graph,torch-compile-amp-cl}" \
    --redo '*|*|training|*' --redo-before "$since"
  return 0
}

run_infer() {
  stage infer 590 python3 -P -m onnxcampo.benchmarks run --out docs/benchmarks/raw --wheels "$WHEELS" --mirror "$OUT/infer" \
    --budget-s "${BENCH_BUDGET_S:-500}" --models "${BENCH_MODELS:-bert,gpt2,resnet50,minilm}" --mode inference \
    --policies "${BENCH_POLICIES:-fp32,amp,ortopt-fp16,campo,campo-fused,campo-graph,campo-fused-graph,campo-fused-yield-graph}" \
    --redo '*|*|inference|campo*' --redo-before "${BENCH_SINCE:-$(date -u +%Y-%m-%dT%H:%M)}"
}

run_finetune() {
  local d=$OUT/finetune corpus=${CORPUS_DIR:-.benchcorpus}
  stage finetune 200 python3 -P -m onnxcampo.benchmarks finetune --provider cuda --corpus-dir "$corpus" --out "$d"
  stage finetune 200 python3 -P -m onnxcampo.benchmarks finetune --provider cuda --train-all --lr 3e-4 --corpus-dir "$corpus" \
    --out "$d"
}

run_rotate() {
  # ResNet-50's step variants and its torch.compile anchors side by side, in rotation, in one process
  stage rotate 590 python3 -P -m onnxcampo.benchmarks rotate --model "${ROTATE_MODEL:-resnet50}" --wheels "$WHEELS" \
    --policies "${ROTATE_POLICIES:-campo-fused-cl-graph,campo-fused-cl-bnsums-graph,campo-fused-graph,campo-fused-bnsums-graph,torch-compile-graph-amp-cl}" \
    --split "${ROTATE_SPLIT:-campo-fused-cl-graph,torch-compile-graph-amp-cl}" \
    --rounds "${ROTATE_ROUNDS:-7}" --out "$OUT/rotate/rotation-${ROTATE_MODEL:-resnet50}.json"
}

run_targets() {
  local rounds=${ROTATE_ROUNDS:-5}
  stage targets 590 python3 -P -m onnxcampo.benchmarks rotate --model resnet50 --wheels "$WHEELS" --rounds "$rounds" \
    --policies campo-fused-cl-graph,campo-fused-cl-means-graph,campo-fused-graph,fp16-fused-cl-graph,fp32-fused-graph,torch-compile-graph-amp-cl,torch-compile-graph-cl \
    --split campo-fused-cl-graph,torch-compile-graph-amp-cl --out "$OUT/targets/rotation-resnet50.json"
  local model
  for model in gpt2 bert; do
    stage targets 590 python3 -P -m onnxcampo.benchmarks rotate --model "$model" --wheels "$WHEELS" --rounds "$rounds" \
      --policies campo-fused-graph,fp16-fused-graph,fp32-fused-graph,amp-graph,torch-compile-graph-amp,torch-compile-graph \
      --out "$OUT/targets/rotation-$model.json"
  done
}

run_loss() {
  stage loss 590 python3 -P -m onnxcampo.benchmarks loss-curves --wheels "$WHEELS" --mirror "$OUT/loss" --budget-s 540
}

if [ $# -eq 0 ]; then
  awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"  # this header
  exit 2
fi
for name in "$@"; do
  case $name in
    checks) run_checks ;;
    cudnn) run_cudnn ;;
    policies) run_policies ;;
    calibrate) run_calibrate ;;
    defaults) run_defaults ;;
    costs) run_costs ;;
    profile) run_profile ;;
    bench) run_bench ;;
    loss) run_loss ;;
    rotate) run_rotate ;;
    targets) run_targets ;;
    infer) run_infer ;;
    finetune) run_finetune ;;
    *) echo "unknown stage $name (checks, cudnn, policies, calibrate, defaults, profile, costs, bench, rotate, targets, loss, infer, finetune)" >&2; exit 2 ;;
  esac
done
