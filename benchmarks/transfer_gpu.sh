#!/usr/bin/env bash
# Issue #53's factor screen and 224 px rows on a machine with one CUDA GPU, in one script (docs/readings.md
# "Transfer learning federated", docs/lab/transfer.md "The classifier started from the ImageNet release").
#
#   .venv/bin/python benchmarks/gpu_data.py --out .gpudata/nat --quality 85     # here: the data copy that travels
#   cp "$W" .gpudata/weights/                                                   # the Lite0 release file
#   bash benchmarks/transfer_gpu.sh OUT [BACK]                                  # there
#
# Every factor of benchmarks/transfer_factors.py named in FACTORS runs for SEEDS (0 1 2), JOBS runs at a time (each
# run a `fedmed experiment` in FLARE's simulator, its 17 sites sharing the GPU), the earliest factors first; no run
# starts after DEADLINE seconds. JOBS defaults to 1: on an H200 (2026-11-28) three such runs at once (51 site
# processes) stalled together in round 7, every site's FLARE messages timing out, while one run alone finished its
# 12 rounds in 162 s (docs/readings.md "Transfer learning federated"). IN_PROCESS=1 runs each experiment's jobs in its
# own process (fedmed experiment --in-process: no FLARE, the same models), where JOBS above 1 shares the card safely. The runs' records (metrics.json, run.json, each factor's summary tables and logs;
# no weights) are packed into BACK/transfer_runs.tgz every 30 s and at the end, so a run cut short still sends back
# what finished. Read them back here with
#   tar xzf transfer_runs.tgz -C results/transfer_gpu && \
#   .venv/bin/python benchmarks/transfer_factors.py --weights W --out results/transfer_gpu --seeds 0 1 2 --table-only \
#     --only FACTORS...
set -u
out=${1:?output folder}
back=${2:-$out}
mkdir -p "$out" "$back"
here=$(pwd)
PY=${PY:-python3}
if ls .whl/*.whl >/dev/null 2>&1 && ! $PY -c "import monai, nvflare, pydantic" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$here
else
    export PYTHONPATH=$here
fi
export PYTHONUNBUFFERED=1
data=${NAT_DIR:-.gpudata/nat}
weights=${WEIGHTS:-.gpudata/weights/efficientnet-lite0-57934424.pth}
factors=${FACTORS:-recipe zero_head+fedavgm recipe@224 zero_head+epochs_2 zero_head+backbone_0.1 zero_head+frozen_bn zero_head+fedadam}
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
git rev-parse --short HEAD 2>/dev/null || true
[ -d "$data" ] || $PY benchmarks/gpu_data.py --out "$data" || exit 1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits \
    -l 5 > "$back/smi.csv" 2>/dev/null &
(while sleep 5; do free -m | awk '/^Mem/ {print $3}'; done) > "$back/host_mem_used_mb.txt" &
mem=$!

pack() {
    (cd "$out" && find . \( -name metrics.json -o -name run.json -o -name 'summary.*' -o -name results.csv \
        -o -name '*.log' \) -size -4M -print0 | tar czf "$back/transfer_runs.tgz.tmp" --null -T -) \
        && mv "$back/transfer_runs.tgz.tmp" "$back/transfer_runs.tgz"
}
(while sleep 30; do pack; done) &
packer=$!
free -g | head -2
# shellcheck disable=SC2086
$PY benchmarks/transfer_factors.py --weights "$weights" --out "$out" --seeds ${SEEDS:-0 1 2} --jobs "${JOBS:-1}" \
    --deadline "${DEADLINE:-380}" ${IN_PROCESS:+--in-process} --only $factors ${EXTRA_SETS:-} \
    --set "dataset.sources=[{path: $data/bus_bra/index.csv, patient_column: case}, {path: $data/busi, site: busi}]" \
    | tee "$back/screen.txt"
kill $packer $mem 2>/dev/null
pack
free -g | head -2
