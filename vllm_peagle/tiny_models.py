"""Deterministic, cached, offline builder of tiny local models for tests and demos.

Everything is derived from the Python standard library's own sources, so no network
or model hub is needed: a byte-level BPE tokenizer, a small Llama target trained on
held-in stdlib files (its held-out loss goes to ``build_report.json``), P-EAGLE
drafters in both checkpoint layouts and a plain EAGLE-3 drafter.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import platform
import shutil
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_peagle.checkpoint import atomic_directory, atomic_write_json, save_drafter
from vllm_peagle.modeling import PEagleDrafter, PEagleDrafterConfig

BUILDER_VERSION = 1
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<mask>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MARKER = "COMPLETE.json"


@dataclass(frozen=True)
class BuildSettings:
    """Everything that determines the built files; hashed into the cache key."""

    seed: int = 0
    vocab_size: int = 4096
    heldout_every: int = 8  # every 8th stdlib module (sorted) is held out
    max_files: int = 0  # 0 = all top-level stdlib modules; small values make micro builds
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 768
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    seq_len: int = 256
    batch_size: int = 8
    train_steps: int = 500
    lr: float = 3e-3
    eval_windows: int = 48
    drafter_layers: int = 2
    aux_layer_ids: tuple[int, ...] = (1, 2, 3)
    eagle3_draft_vocab: int = 1024
    num_speculative_tokens: int = 4


@dataclass(frozen=True)
class LocalModels:
    """Paths of one completed build."""

    root: Path
    tokenizer: Path
    target: Path
    peagle_native: Path
    peagle_speculators: Path
    eagle3: Path
    report: Path

    @classmethod
    def at(cls, root: Path) -> LocalModels:
        return cls(
            root=root,
            tokenizer=root / "tokenizer",
            target=root / "target",
            peagle_native=root / "peagle-native",
            peagle_speculators=root / "peagle-speculators",
            eagle3=root / "eagle3",
            report=root / "build_report.json",
        )

    def load_report(self) -> dict[str, Any]:
        return json.loads(self.report.read_text())


def default_cache_dir() -> Path:
    env = os.environ.get("VLLM_PEAGLE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "vllm-peagle"


def build_key(settings: BuildSettings) -> str:
    # The stdlib text (hence the Python version) is part of the input data.
    blob = json.dumps(
        {"builder": BUILDER_VERSION, "python": platform.python_version(), **asdict(settings)},
        sort_keys=True,
    )
    return f"tiny-v{BUILDER_VERSION}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def ensure_local_models(
    cache_dir: Path | None = None,
    settings: BuildSettings | None = None,
    progress: bool = True,
) -> LocalModels:
    """Return the cached build, building it first if it is missing or incomplete."""
    settings = settings or BuildSettings()
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    models = LocalModels.at(base / build_key(settings))
    if (models.root / MARKER).is_file():
        return models
    base.mkdir(parents=True, exist_ok=True)
    with _locked(base / f".{models.root.name}.lock"):
        if (models.root / MARKER).is_file():  # another process finished meanwhile
            return models
        shutil.rmtree(models.root, ignore_errors=True)  # leftovers of an interrupted build
        models.root.mkdir(parents=True)
        _build(models, settings, progress)
    return models


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def _deterministic_torch(seed: int) -> Iterator[None]:
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(2)  # fixed reduction order across machines
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det)


def stdlib_split(settings: BuildSettings) -> tuple[list[Path], list[Path]]:
    """Top-level stdlib modules, sorted; every ``heldout_every``-th one is held out."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    if settings.max_files:
        files = files[: settings.max_files]
    held_in = [f for i, f in enumerate(files) if i % settings.heldout_every != 1]
    held_out = [f for i, f in enumerate(files) if i % settings.heldout_every == 1]
    return held_in, held_out


def _read(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def build_tokenizer(texts: list[str], settings: BuildSettings, out: Path) -> Any:
    """Train a byte-level BPE tokenizer and save it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=settings.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        mask_token="<mask>",
        model_max_length=settings.max_position_embeddings,
    )
    fast.chat_template = CHAT_TEMPLATE
    with atomic_directory(out) as stage:
        fast.save_pretrained(stage)
    return fast


def _token_stream(tokenizer: Any, texts: list[str]) -> torch.Tensor:
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(eos)  # document separator
    return torch.tensor(ids, dtype=torch.long)


def _target_config(settings: BuildSettings, tokenizer: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=settings.hidden_size,
        intermediate_size=settings.intermediate_size,
        num_hidden_layers=settings.num_layers,
        num_attention_heads=settings.num_heads,
        num_key_value_heads=settings.num_kv_heads,
        max_position_embeddings=settings.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": settings.rope_theta},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
    )


def train_target(
    settings: BuildSettings, tokenizer: Any, train_ids: torch.Tensor, bar: Any
) -> tuple[Any, float]:
    """Train the tiny Llama target with AdamW + warmup/cosine; returns (model, last loss)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(_target_config(settings, tokenizer)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup, steps = max(1, settings.train_steps // 10), settings.train_steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warmup)
            * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, steps) / steps)))
        ),
    )
    gen = torch.Generator().manual_seed(settings.seed)
    span = settings.seq_len
    loss_value = float("nan")
    for _ in range(steps):
        starts = torch.randint(0, len(train_ids) - span, (settings.batch_size,), generator=gen)
        batch = torch.stack([train_ids[s : s + span] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss  # HF shifts labels itself
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = float(loss.detach())
        bar.set_postfix(loss=f"{loss_value:.3f}")
        bar.update(1)
    return model.eval(), loss_value


@torch.no_grad()
def heldout_loss(model: Any, ids: torch.Tensor, seq_len: int, max_windows: int) -> float:
    """Mean next-token loss over non-overlapping held-out windows."""
    n = min(max_windows, (len(ids) - 1) // seq_len)
    windows = ids[: n * seq_len].view(n, seq_len)
    losses = [float(model(input_ids=w[None], labels=w[None]).loss) for w in windows]
    return sum(losses) / len(losses)


def _new_drafter(
    settings: BuildSettings, target: Any, mask_id: int | None, keep: torch.Tensor | None
) -> PEagleDrafter:
    cfg = PEagleDrafterConfig(
        hidden_size=settings.hidden_size,
        num_hidden_layers=settings.drafter_layers,
        num_attention_heads=settings.num_heads,
        num_key_value_heads=settings.num_kv_heads,
        intermediate_size=settings.intermediate_size,
        vocab_size=target.config.vocab_size,
        draft_vocab_size=None if keep is None else len(keep),
        target_hidden_size=target.config.hidden_size,
        rms_norm_eps=target.config.rms_norm_eps,
        rope_theta=settings.rope_theta,
        max_position_embeddings=settings.max_position_embeddings,
        eagle_aux_hidden_state_layer_ids=list(settings.aux_layer_ids),
        mask_token_id=mask_id,
    )
    drafter = PEagleDrafter(cfg)  # random init from the seeded global RNG
    with torch.no_grad():
        # Start from the target's embeddings/head, as EAGLE training does.
        drafter.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        head = target.lm_head.weight
        drafter.lm_head.weight.copy_(head if keep is None else head[keep])
        if keep is not None and drafter.d2t is not None:
            drafter.d2t.copy_(keep - torch.arange(len(keep)))
    return drafter.eval()


def _build(models: LocalModels, settings: BuildSettings, progress: bool) -> None:
    from tqdm.auto import tqdm

    t0 = time.monotonic()
    stages = 5
    with (
        _deterministic_torch(settings.seed),
        tqdm(total=settings.train_steps + stages, desc="tiny models", disable=not progress) as bar,
    ):
        held_in, held_out = stdlib_split(settings)
        train_texts, eval_texts = _read(held_in), _read(held_out)
        bar.set_description("tokenizer")
        tokenizer = build_tokenizer(train_texts, settings, models.tokenizer)
        train_ids, eval_ids = (
            _token_stream(tokenizer, train_texts),
            _token_stream(tokenizer, eval_texts),
        )
        bar.update(1)
        bar.set_description("target")
        target, train_loss = train_target(settings, tokenizer, train_ids, bar)
        bar.set_description("held-out loss")
        loss = heldout_loss(target, eval_ids, settings.seq_len, settings.eval_windows)
        bar.update(1)
        with atomic_directory(models.target) as stage:
            target.save_pretrained(stage, safe_serialization=True)
            tokenizer.save_pretrained(stage)
        bar.update(1)
        bar.set_description("drafters")
        mask_id = tokenizer.convert_tokens_to_ids("<mask>")
        torch.manual_seed(settings.seed + 1)  # drafters do not depend on training's RNG use
        peagle = _new_drafter(settings, target, mask_id, None)
        save_drafter(peagle, models.peagle_native, tokenizer_dir=models.tokenizer)
        save_drafter(
            peagle,
            models.peagle_speculators,
            layout="speculators",
            num_speculative_tokens=settings.num_speculative_tokens,
            verifier=str(models.target.resolve()),
            tokenizer_dir=models.tokenizer,
        )
        counts = torch.bincount(train_ids, minlength=len(tokenizer))
        keep = counts.topk(settings.eagle3_draft_vocab).indices.sort().values
        save_drafter(
            _new_drafter(settings, target, None, keep),
            models.eagle3,
            tokenizer_dir=models.tokenizer,
        )
        bar.update(1)
        report = {
            "builder_version": BUILDER_VERSION,
            "settings": asdict(settings),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "vocab_size": len(tokenizer),
            "ln_vocab": math.log(len(tokenizer)),
            "heldout_loss": loss,
            "heldout_over_ln_vocab": loss / math.log(len(tokenizer)),
            "final_train_loss": train_loss,
            "train_tokens_seen": settings.train_steps * settings.batch_size * settings.seq_len,
            "train_corpus_tokens": len(train_ids),
            "heldout_files": [f.name for f in held_out],
            "mask_token_id": mask_id,
            "build_seconds": round(time.monotonic() - t0, 1),
        }
        atomic_write_json(models.report, report)
        atomic_write_json(
            models.root / MARKER, {"key": models.root.name, "report": report["heldout_loss"]}
        )
        bar.update(1)
