#!/usr/bin/env bash
# The GPU checks of issue #54 in one script, for a machine with one CUDA GPU (docs/lab/performance.md "On a GPU").
#
#   bash benchmarks/gpu_check.sh 2d OUT   # bench_gpu.py (DenseNet121 224 px bf16, batch 32 and 128) + busi_224.yaml
#   bash benchmarks/gpu_check.sh 3d OUT   # bench_gpu.py --task seg3d (SegResNet, 96^3) + brats_1mm.yaml
#
# Data: BUSI_DIR (default ../shared/data/busi) and BRATS_DIR (default ../shared/data/brats2013). Python packages
# missing on the machine may lie as wheels in .whl/ (installed into /tmp/site first). The simulator runs are shrunk
# in rounds only (ROUNDS, default 3 for 2D and 2 for 3D); the sites share the one GPU. Peak device memory is what
# nvidia-smi reads for the whole card (all sites together), sampled every 200 ms.
set -u
part=${1:?2d or 3d}
out=${2:-/tmp/gpu_check}
mkdir -p "$out"
here=$(pwd)
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$here
else
    export PYTHONPATH=$here
fi
export PYTHONUNBUFFERED=1
python3 -c "import torch, monai; print('torch', torch.__version__, 'monai', monai.__version__, torch.cuda.get_device_name(0))"
git rev-parse --short HEAD 2>/dev/null || true
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$out/smi_$part.csv" &
smi=$!

sim() {  # sim NAME CONFIG DATA ROUNDS: one method of a shipped config in FLARE's simulator
    local name=$1 cfg=$2 data=$3 rounds=$4
    shift 4
    local t0=$(date +%s)
    timeout 420 python3 -m fedmed experiment "$cfg" --out "/tmp/$name" --methods FedAvg --set "dataset.path=$data" \
        --set "train.rounds=$rounds" --set 'seeds=[0]' --set 'references=[]' "$@" > "$out/$name.log" 2>&1
    echo "$name: exit $? after $(( $(date +%s) - t0 )) s"
    tail -5 "$out/$name.log"
    python3 - "$name" <<'EOF'
import glob, json, sys
name = sys.argv[1]
m = json.load(open(f"/tmp/{name}/runs/seed0/FedAvg/server/metrics.json"))
n_train = sum(len(json.load(open(f)).get("training", [])) for f in glob.glob(f"/tmp/{name}/data/seed0/site-*.json"))
t = [0.0] + [r["elapsed"] for r in m["rounds"]]
per = [(r["task"], r["round"], round(b - a, 2)) for r, a, b in zip(m["rounds"], t, t[1:])]
print(f"{name}: status {m['status']}, wall {m['wall_seconds']:.1f} s, {len(m['sites'])} sites, {n_train} training "
      f"items in all; per task (task, round, s): {per}")
print(f"{name}: last summary: {m['rounds'][-1]['summary'].get('mean')}")
EOF
    cp "/tmp/$name/runs/seed0/FedAvg/server/metrics.json" "$out/${name}_metrics.json" 2>/dev/null
}

if [ "$part" = 2d ]; then
    busi=${BUSI_DIR:-$here/../shared/data/busi}
    python3 benchmarks/bench_gpu.py --data "$busi" --precision bf16 --pairs 3 --json "$out/bench_bf16_b32.json"
    python3 benchmarks/bench_gpu.py --data "$busi" --precision bf16 --batch-size 128 --pairs 3 \
        --json "$out/bench_bf16_b128.json"
    sim busi224 app_configs/busi_224.yaml "$busi" "${ROUNDS:-3}"
else
    brats=${BRATS_DIR:-$here/../shared/data/brats2013}
    python3 benchmarks/bench_gpu.py --task seg3d --precision bf16 --pairs 3 --json "$out/bench_seg3d.json"
    sim brats1mm app_configs/brats_1mm.yaml "$brats" "${ROUNDS:-2}" --set train.local_epochs=2
fi
kill $smi 2>/dev/null
sort -n "$out/smi_$part.csv" | tail -1 | awk '{printf "peak device memory (nvidia-smi, whole card): %.2f GiB\n", $1/1024}'
