"""How much a quantized layout costs: next-token distributions of each variant vs the source.

For every (format, policy) the source checkpoint is quantized with
:func:`~dsv4.weights.quantize.quantize_checkpoint`, loaded, and run over held-out sequences next
to the source. Per variant, and per tensor group quantized alone (attention incl.
``indexer.wq_b``, routed experts, shared expert; for policy ``all`` also head, router and the
compressor/indexer helpers), it reports:

    mean_kl        mean over all positions of KL(source || variant) of the next-token softmax
    top1_agree     fraction of positions whose argmax token agrees
    max_logit_err  max |logit_source - logit_variant| over all positions and tokens
    bytes          tensor bytes of the variant checkpoint

A group's numbers do not depend on the policy (its format is the same in both), so each is
measured once per format and reported under every policy that quantizes it. A progress bar counts
the tokens run through the source and every variant; sequences longer than the model's
``max_position_embeddings`` are refused before anything runs.
"""

from __future__ import annotations

import csv
import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import ModelConfig
from ..engine.batch import Row, ScheduledBatch
from ..engine.runner import Runner
from ..errors import UsageError
from ..progress import progress_bar
from .loader import INDEX_FILE, check_checkpoint, list_shards, load_model
from .quantize import check_args, linear_group, quantize_checkpoint

__all__ = ["eval_quant", "held_out_sequences", "model_logits", "compare_logits", "format_table",
           "write_csv", "CSV_FIELDS"]

CSV_FIELDS = ("format", "policy", "group", "mean_kl", "top1_agree", "max_logit_err", "bytes")
BASE_GROUPS = ("attention", "routed_experts", "shared_expert")
ALL_ONLY_GROUPS = ("head", "router", "helpers")
TOTAL = "total"

# Held-out text (written for this project) used when the checkpoint has a tokenizer.
_TEXT = """\
The lighthouse keeper wrote down the weather every morning at six: wind from the north-west,
a low grey sky, the sea running high against the rocks below the tower. In forty-one years he had
missed only three entries, and each of those was marked with a small red cross and a note.
Ships passed less often now. Satellite navigation had made the light almost ornamental, yet the
harbour board kept paying for the lamp, the paint and the keeper, because nobody wanted to be the
one who switched it off. On clear nights he counted the stars he could still name: Vega, Deneb,
Altair, the summer triangle; Capella and Aldebaran in winter. His granddaughter, who studied
mathematics in the city, sent him puzzles by post. The last one asked how many ways there are to
tile a strip of length ten with squares and dominoes; he solved it on the back of a tide table and
mailed the answer, 89, with a drawing of the tower. In spring the gulls returned, loud and
quarrelsome, and the first tourists climbed the 217 steps to take photographs of the view.
"""


def held_out_sequences(src: Path, vocab_size: int, n_seqs: int, seq_len: int, seed: int) -> list[torch.Tensor]:
    """``n_seqs`` int64 sequences of ``seq_len`` tokens: windows of the embedded text (BOS first)
    when ``src`` has a tokenizer whose ids fit the vocabulary, else seeded random ids in [2, vocab)."""
    gen = torch.Generator().manual_seed(seed)
    if (src / "tokenizer.json").is_file():
        from ..text.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(src)
        ids = tok.encode(_TEXT)
        if ids and max(ids) < vocab_size and tok.bos_id < vocab_size:
            ids = ids * (seq_len // len(ids) + 2)  # long enough for any window
            starts = torch.randint(0, len(ids) - seq_len, (n_seqs,), generator=gen).tolist()
            return [torch.tensor([tok.bos_id] + ids[s:s + seq_len - 1], dtype=torch.int64) for s in starts]
    return [torch.randint(2, vocab_size, (seq_len,), generator=gen, dtype=torch.int64) for _ in range(n_seqs)]


def model_logits(path: Path, seqs: Sequence[torch.Tensor], bar=None) -> list[torch.Tensor]:
    """fp32 logits ``[seq_len, vocab]`` of every position of each sequence, checkpoint at ``path``
    loaded in float32 (quantized weights stay packed). ``bar`` (a tqdm) advances per token."""
    model, _ = load_model(path, dtype=torch.float32, progress=False)
    runner = Runner(model, max_num_seqs=1, max_model_len=max(len(s) for s in seqs) + 8)
    out = []
    for ids in seqs:
        runner.reset([0])
        chunks = []
        for lo in range(0, len(ids), runner.max_num_batched_tokens):  # the runner's own chunks: same numbers
            chunk = ids[lo:lo + runner.max_num_batched_tokens]
            row = Row(0, lo, tuple(chunk.tolist()), sample=False, logits=True)   # every position's logits
            chunks.append(runner.run(ScheduledBatch((row,))).logits[0].float())
            if bar is not None:
                bar.update(len(chunk))
        out.append(torch.cat(chunks))
    return out


def compare_logits(ref: Sequence[torch.Tensor], test: Sequence[torch.Tensor]) -> dict[str, float]:
    """``mean_kl`` (KL(ref || test), mean over all positions), ``top1_agree``, ``max_logit_err``."""
    r, t = torch.cat(list(ref)).double(), torch.cat(list(test)).double()  # [P, V]
    logp, logq = torch.log_softmax(r, -1), torch.log_softmax(t, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1).clamp_min(0.0)  # [P]; >= 0 up to rounding
    return {"mean_kl": float(kl.mean()),
            "top1_agree": float((r.argmax(-1) == t.argmax(-1)).double().mean()),
            "max_logit_err": float((r - t).abs().max())}


def _checkpoint_bytes(path: Path) -> int:
    index = path / INDEX_FILE
    if index.is_file():
        return int(json.loads(index.read_text())["metadata"]["total_size"])
    return sum(f.stat().st_size for f in list_shards(path))


def _source_groups(src: Path) -> set[str]:
    """Linear groups present in the source checkpoint."""
    groups = set()
    for file in list_shards(src):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            groups.update(linear_group(n[: -len(".weight")]) for n in f.keys() if n.endswith(".weight"))
    return groups


class _Evaluator:
    """Quantizes one variant at a time into ``work``, measures it against the source, removes it."""

    def __init__(self, src: Path, work: Path, seqs: list[torch.Tensor], dense_format: str, bar):
        self.src, self.work, self.seqs, self.dense_format, self.bar = src, work, seqs, dense_format, bar
        bar.set_description("eval-quant: source")
        self.ref = model_logits(src, seqs, bar)
        self.source_bytes = _checkpoint_bytes(src)

    def measure(self, fmt: str, policy: str, only_groups: set[str] | None) -> dict[str, float]:
        label = f"{fmt}-{policy}-{'-'.join(sorted(only_groups)) if only_groups else TOTAL}"
        dst = self.work / label
        self.bar.set_description(f"eval-quant: {label}")
        try:
            quantize_checkpoint(self.src, dst, fmt, policy, self.dense_format, progress=False,
                                overwrite=True, only_groups=only_groups, device="cpu")
            metrics = compare_logits(self.ref, model_logits(dst, self.seqs, self.bar))
            metrics["bytes"] = _checkpoint_bytes(dst)
        finally:
            shutil.rmtree(dst, ignore_errors=True)
        return metrics


def eval_quant(src: Path, formats: list[str], policies: list[str], n_seqs: int = 4, seq_len: int = 64,
               seed: int = 0, dense_format: str = "fp8", csv_path: Path | None = None,
               work_dir: Path | None = None, verbose: bool = True) -> list[dict]:
    """Measure every (format, policy) variant of checkpoint ``src`` against it (see module doc).

    Returns one row per (format, policy, group) with the keys of :data:`CSV_FIELDS`; group
    ``total`` is the variant itself. Prints the table to stdout when ``verbose`` and writes the
    rows to ``csv_path`` if given (its directory must exist). Variants are written under ``work_dir``
    (default: the system's temporary directory; created if missing, but not its parents), one at a
    time, and removed after measuring.
    """
    src = Path(src)
    for fmt in formats:
        for policy in policies:
            check_args(fmt, policy, dense_format, "ue8m0")
    if n_seqs <= 0 or seq_len <= 1:
        raise UsageError(f"need at least one sequence of >= 2 tokens, got {n_seqs} x {seq_len}")
    config = ModelConfig.from_file(src / "config.json")
    check_checkpoint(src)  # the loader's header checks: a broken source is one named error, not a traceback
    if seq_len > config.max_position_embeddings:
        raise UsageError(f"sequence length (--length) {seq_len:,} exceeds the model's max_position_embeddings "
                         f"({config.max_position_embeddings:,}, {src / 'config.json'})")
    _check_outputs(csv_path, work_dir)
    seqs = held_out_sequences(src, config.vocab_size, n_seqs, seq_len, seed)
    plan = _plan(formats, policies, _source_groups(src))
    if work_dir is not None:
        Path(work_dir).mkdir(exist_ok=True)
    runs = 1 + len({key for _, _, key in plan})  # the source, then every distinct variant
    with tempfile.TemporaryDirectory(prefix="dsv4-eval-quant-", dir=work_dir) as work, \
            progress_bar(verbose, total=runs * n_seqs * seq_len, unit="tok", unit_scale=True) as bar:
        ev = _Evaluator(src, Path(work), seqs, dense_format, bar)
        rows: list[dict] = []
        measured: dict[tuple, dict[str, float]] = {}
        for fmt, policy, (m_fmt, m_policy, group) in plan:
            key = (m_fmt, m_policy, group)
            if key not in measured:
                measured[key] = ev.measure(m_fmt, m_policy, None if group == TOTAL else {group})
            rows.append({"format": fmt, "policy": policy, "group": group, **measured[key]})
        source_bytes = ev.source_bytes
    if verbose:
        print(format_table(rows, source_bytes, n_seqs, seq_len))
    if csv_path is not None:
        write_csv(rows, Path(csv_path))
    return rows


def _check_outputs(csv_path: Path | None, work_dir: Path | None) -> None:
    """Refuse, before anything runs, a ``--csv`` file or ``--work-dir`` whose parent directory is
    missing (a typo in a path should not create a tree of directories). ``--work-dir`` itself is
    created when missing, like ``mkdir`` does."""
    for flag, path in (("--csv", csv_path), ("--work-dir", work_dir)):
        if path is None:
            continue
        path = Path(path)
        if flag == "--csv" and path.is_dir():
            raise UsageError(f"--csv {path} is a directory; give the CSV file's path")
        if flag == "--work-dir" and path.exists() and not path.is_dir():
            raise UsageError(f"--work-dir {path} exists and is not a directory")
        parent = path.absolute().parent
        if not parent.is_dir():
            raise UsageError(f"{flag} {path}: directory {parent} does not exist (create it first)")


def _plan(formats: list[str], policies: list[str], present: set[str]) -> list[tuple[str, str, tuple]]:
    """Rows to report as ``(format, policy, (format, policy, group) to measure)``.

    A group's numbers do not depend on the policy (its format is the same in both), so a group
    row is measured once per format, under ``all``, and shared by every policy that quantizes it.
    """
    plan = []
    for fmt in formats:
        for policy in policies:
            plan.append((fmt, policy, (fmt, policy, TOTAL)))
            for group in BASE_GROUPS + (ALL_ONLY_GROUPS if policy == "all" else ()):
                if group in present:
                    plan.append((fmt, policy, (fmt, "all", group)))
    return plan


def format_table(rows: Sequence[dict], source_bytes: int | None = None, n_seqs: int | None = None,
                 seq_len: int | None = None) -> str:
    """The rows as an aligned text table."""
    head = f"{'format':<7} {'policy':<6} {'group':<15} {'mean KL':>10} {'top-1':>7} {'max|dlogit|':>12} {'MiB':>9}"
    lines = []
    if source_bytes is not None:
        lines.append(f"source: {source_bytes / 2**20:.2f} MiB"
                     + (f"; {n_seqs} sequences x {seq_len} tokens" if n_seqs else ""))
    lines += [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['format']:<7} {r['policy']:<6} {r['group']:<15} {r['mean_kl']:>10.3e} "
                     f"{r['top1_agree']:>7.3f} {r['max_logit_err']:>12.4f} {r['bytes'] / 2**20:>9.2f}")
    return "\n".join(lines)


def write_csv(rows: Sequence[dict], path: Path) -> None:
    """Write ``rows`` with the columns of :data:`CSV_FIELDS` (a header line first)."""
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)

