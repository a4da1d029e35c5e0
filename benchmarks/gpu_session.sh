#!/usr/bin/env bash
# Runs benchmark steps on a GPU machine and leaves their results under $OUT (or ./gpu-out).
# Usage: benchmarks/gpu_session.sh STEP...   steps: env ig ig-conformance ig-conformance-split ig-auto ig-auto-cli tracin tracin-projected planner
#        ablation panel gputests scaling
#        planner-traced planner-recommend planner-recommend-all startup lm-attribution tracin-lm tracin-lm-pca
#        tracin-lm-dattri
# Packages missing on the machine travel as wheels in .whl/ (see benchmarks/README.md).
set -uo pipefail
out="${OUT:-gpu-out}"
mkdir -p "$out"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 GPUOPT_TUI_HOME=/tmp/gpuopt-home
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_' | sed 's/NVIDIA_//;s/_80GB_HBM3//')
card=${card:-gpu}

for step in "$@"; do
  echo "=== $step ($(date -u +%H:%M:%S))"
  case "$step" in
    env)
      { nvidia-smi; python3 -c "import torch, transformers, sys; print(sys.version); print('torch', torch.__version__, 'transformers', transformers.__version__)"; } > "$out/env.txt" 2>&1 ;;
    ig)
      python3 -m gpuopt_tui gpu --record "$out/trace_${card}_ig.jsonl" --interval 1 --duration 900 --redact &
      rec=$!
      python3 benchmarks/ig_bench.py --compile --out "$out/ig_${card}.md" 2>&1 | tail -60
      kill "$rec"; wait "$rec"
      python3 benchmarks/ig_variants.py --out "$out/ig_variants_${card}.md" 2>&1 | grep "samples/s" ;;
    ig-conformance)  # IG_CONFORMANCE_ARGS: e.g. --families bert roberta
      python3 benchmarks/ig_conformance.py --out "$out/ig_conformance_${card}.md" ${IG_CONFORMANCE_ARGS:-} 2>&1 \
        | grep -v "^|" | tail -40 ;;
    ig-conformance-split)  # IG_PROCS processes (default: one per GPU), the (family, task) pairs of IG_PAIRS dealt
      # out to them in turn, the results merged; processes sharing a GPU make its rates meaningless (say so: IG_NOTE)
      gpus=$(nvidia-smi -L | wc -l)
      procs=${IG_PROCS:-$gpus}
      read -ra pairs <<< "${IG_PAIRS:-distilbert:majority roberta:majority albert:majority electra:majority distilbert:planted roberta:planted albert:planted electra:planted bert:planted deberta-v2:planted bert:majority deberta-v2:majority}"
      for ((g = 0; g < procs; g++)); do
        (for ((k = g; k < ${#pairs[@]}; k += procs)); do
           f=${pairs[k]%%:*} t=${pairs[k]##*:}
           CUDA_VISIBLE_DEVICES=$((g % gpus)) python3 benchmarks/ig_conformance.py --families "$f" --tasks "$t" \
             --out "$out/conformance_part_${f}_${t}.md" --note "${IG_NOTE:-}" ${IG_CONFORMANCE_ARGS:-}
         done > "$out/conformance_gpu$g.log" 2>&1) &
      done
      wait
      parts=()
      for p in "${pairs[@]}"; do
        f=${p%%:*} t=${p##*:}
        [ -f "$out/conformance_part_${f}_${t}.json" ] && parts+=("$out/conformance_part_${f}_${t}.json")
      done
      python3 benchmarks/ig_conformance.py --merge "${parts[@]}" --out "$out/ig_conformance_${card}.md" | grep -v "^|" | tail -20 ;;
    ig-auto)
      python3 benchmarks/ig_auto_bench.py --out "$out/ig_auto_${card}.md" 2>&1 | tail -40 ;;
    ig-auto-cli)  # ig_auto_bench.py's fine-tuned model and texts through `gpuopt-tui run`, auto steps at 1e-2, in
      # batches of each size of IG_AUTO_BATCHES in turn (a size twice: the second run finds the kernels compiled)
      python3 benchmarks/ig_auto_bench.py --export /tmp/ig-export 2>&1 | tail -3
      sed "s|models/bert-finetuned|/tmp/ig-export/model|;s|data/benchmark.jsonl|/tmp/ig-export/texts.jsonl|" \
        profiles/ig-40k-auto.toml > /tmp/ig-export/auto.toml
      n=0
      for batch in ${IG_AUTO_BATCHES:-128 32}; do
        n=$((n + 1))
        { echo "\$ gpuopt-tui run ig-40k-auto (model and data: the export) --set n_samples=2048 --set batch_size=$batch"
          python3 -m gpuopt_tui run /tmp/ig-export/auto.toml --set n_samples=2048 --set batch_size="$batch" 2>&1
          run=$(ls -td "$GPUOPT_TUI_HOME"/runs/* | head -1)
          cat "$run/log.txt"; python3 -m json.tool "$run/results/summary.json" | head -80
        } > "$out/ig_auto_cli_${card}_${n}_b${batch}.txt"
        grep -A3 "^finished" "$out/ig_auto_cli_${card}_${n}_b${batch}.txt"
      done ;;
    tracin)
      python3 benchmarks/tracin_bench.py --checkpoint-cache /tmp/tracin-ckpt --out "$out/tracin_${card}.md" 2>&1 | tail -20
      python3 benchmarks/tracin_bench.py --train 32768 --checkpoint-cache /tmp/tracin-ckpt \
        --modes closed-fp32,closed-low,closed-low-serial,captum-default,captum-sw,captum-sw-bf16,captum-fast \
        --out "$out/tracin_${card}_32k.md" 2>&1 | tail -20 ;;
    tracin-projected)  # dattri travels as a wheel in .whl/ (it needs scipy, pyyaml and tqdm from the machine)
      for model in small base; do
        python3 benchmarks/tracin_projected_bench.py --model "$model" --checkpoint-cache /tmp/tracin-ckpt \
          --out "$out/tracin_projected_${model}_${card}.md" 2>&1 | tail -30
      done ;;
    planner)  # each case in parts, each part in a fresh process, then merged; PLANNER_CASES picks the cases
      mkdir -p "$out/raw"
      cases=${PLANNER_CASES:-qwen2-full qwen2-lora qwen2-ckpt llama-full llama-ckpt llama-lora mistral-full mistral-lora-ckpt gpt2-full-bf16 bert-full-bf16}
      for c in $cases; do
        for part in accuracy closed-form measured-plan; do
          python3 benchmarks/memory_planner_bench.py --cases "$c" --parts "$part" --out "$out/raw/mp_${c}_${part}.md" 2>&1 | tail -2
        done
        python3 benchmarks/memory_planner_bench.py --cases "$c" --parts measured-run --plan "$out/raw/mp_${c}_measured-plan.json" \
          --out "$out/raw/mp_${c}_measured-run.md" 2>&1 | tail -2
      done
      python3 benchmarks/memory_planner_bench.py --merge "$out"/raw/mp_*.json --out "$out/memory_planner_${card}.md" ;;
    ablation)
      for section in extraction:lora16 extraction:lora64 extraction:hidden extraction:product; do
        timeout 110 python3 benchmarks/ablation_bench.py --sections "$section" --append --out "$out/ablation_extraction_${card}.md" 2>&1 | tail -15
      done ;;
    panel)
      python3 benchmarks/ig_bench.py --skip-captum --samples 256 --out /tmp/ig_load.md >/dev/null 2>&1 &
      load=$!
      python3 benchmarks/gpu_panel_bench.py --duration 60 --interval 1 --size 100x30 --tools gpuopt-tui,nvitop --rows --out "$out/gpu_panel_${card}.md" 2>&1 | tail -30
      kill "$load" 2>/dev/null; wait "$load" 2>/dev/null ;;
    scaling)
      python3 benchmarks/scaling_bench.py --processes "$(nvidia-smi -L | wc -l)" --samples 8192 --out "$out/scaling_${card}.md" 2>&1 | tail -25 ;;
    planner-traced)  # the traced tier against the real step (PLANNER_TRACED_BUDGET seconds, default 240)
      python3 benchmarks/planner_traced.py --devices cpu,cuda --budget "${PLANNER_TRACED_BUDGET:-240}" \
        --out "$out/planner_traced_${card}.json" 2>&1 | tail -30 ;;
    planner-recommend)  # the traced tier's recommendations run in the HF Trainer (PLANNER_RECOMMEND_ARGS: cases,
      # budgets; default: up to four cases at a 40 GiB card, no new case after 300 s: about 8 minutes)
      python3 benchmarks/planner_traced.py --recommend ${PLANNER_RECOMMEND_ARGS:---cases llama-1b-full,phi2-lora,gemma-2b-full-ckpt,bert-base-cls --no-card --budget 300} \
        --out "$out/planner_recommend_${card}.json" > "$out/planner_recommend.log" 2>&1; tail -40 "$out/planner_recommend.log" ;;
    planner-recommend-all)  # RECOMMEND_CASES (default: every case of planner_traced.py) planned 8 at a time, then
      # each run in the Trainer (40 GiB budget and micro-batch 1); no new case after RECOMMEND_BUDGET s (420)
      python3 benchmarks/planner_traced.py --recommend --no-card --plan-jobs 8 --budget "${RECOMMEND_BUDGET:-420}" \
        ${RECOMMEND_CASES:+--cases "$RECOMMEND_CASES"} --out "$out/planner_recommend_all_${card}.json" \
        > "$out/planner_recommend_all.log" 2>&1; tail -40 "$out/planner_recommend_all.log" ;;
    startup)  # time to the first computed batch: the demos and a local 30M model on the GPU
      python3 benchmarks/run_startup.py --model-size 30m --device cuda --rounds 2 --machine "$card" \
        --title "one $card, --device cuda" --out "$out/run_startup_${card}.md" 2>&1 | tail -30 ;;
    lm-attribution)  # a 1B-class decoder (LM_SHAPE, default llama-1b) against Captum's LLMGradientAttribution
      python3 benchmarks/lm_attribution.py --shape "${LM_SHAPE:-llama-1b}" ${LM_ARGS:-} \
        --out "$out/lm_attribution_${LM_SHAPE:-llama-1b}_${card}.md" > "$out/lm_attribution.log" 2>&1; tail -30 "$out/lm_attribution.log" ;;
    tracin-lm)  # TracIn over LoRA adapter checkpoints of a 1B-class decoder through the CLI (TRACIN_LM_ARGS: extra args)
      python3 benchmarks/tracin_lm_bench.py --work /tmp/tracin-lm ${TRACIN_LM_ARGS:-} \
        --out "$out/tracin_lm_${card}.md" > "$out/tracin_lm.log" 2>&1; tail -30 "$out/tracin_lm.log" ;;
    tracin-lm-pca)  # the same, trained 1B model: exact against 16x16 random, 16x16 PCA and 32x32 random; then the
      # cold and cached rows with PCA directions (their fitting pass's cost, the cache read back with them)
      python3 benchmarks/tracin_lm_bench.py --work /tmp/tracin-lm --rows exact,cold,cached --basis pca --train 2048 \
        --words 264 --pretrain-steps 600 --pretrain-lr 5e-4 --exact-train 256 --exact-queries 16 \
        --exact-projections 16,16pca,32 --out "$out/tracin_lm_pca_${card}.md" > "$out/tracin_lm_pca.log" 2>&1
      tail -30 "$out/tracin_lm_pca.log" ;;
    tracin-lm-dattri)  # the trained 1B model: our cold run and dattri's LoGra (a wheel in .whl/) side by side, both
      # against exact LoRA-gradient TracIn on a subset (TQDM_DISABLE: dattri's progress bars, read when tqdm is imported)
      TQDM_DISABLE=1 python3 benchmarks/tracin_lm_bench.py --work /tmp/tracin-lm --rows cold,exact,dattri --train 1024 --queries 64 \
        --words 264 --pretrain-steps 600 --pretrain-lr 5e-4 --exact-train 256 --exact-queries 16 --dattri-train 1024 \
        ${TRACIN_LM_ARGS:-} --out "$out/tracin_lm_dattri_${card}.md" > "$out/tracin_lm_dattri.log" 2>&1
      tail -30 "$out/tracin_lm_dattri.log" ;;
    gputests)
      python3 -m pytest -m gpu -p no:cacheprovider -q -rs tests/core tests/jobs 2>&1 | tee "$out/gpu_tests_${card}.txt" | tail -40 ;;
    *) echo "unknown step $step" ;;
  esac
done
ls -la "$out"
