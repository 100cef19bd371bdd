"""New token embeddings as a Trainable: textual inversion, and the embeddings of pivotal tuning.

:class:`TokenEmbeddings` adds ``n`` new tokens (``tok``, ``tok1`` ... ``tok{n-1}``, sd-scripts' naming) to every
tokenizer of the family and one row per token to every text encoder's token-embedding table (SDXL: CLIP-L and
OpenCLIP-bigG), initialised from ``--init_word`` (its token vectors, cycled) or from ``--weights``. The trained
tensors are separate parameters that a forward hook puts in place of the new rows' lookups, so the optimizer
only ever sees the new rows: every other row of the table, and every other weight, stays bit-identical (sd-scripts
trains the whole table and restores the old rows after each step; the result for the new rows is the same except
that ``--max_grad_norm`` here measures the new rows' gradient only, and that a step whose batch holds no caption
with the token changes nothing here, where sd-scripts' optimizer steps with a zero gradient for the new rows, which
a momentum optimizer still moves: library/text/token_captions.py).

Files (docs/formats.md "Textual-inversion embeddings"; sd-scripts' ``train_textual_inversion.py`` and
``sdxl_train_textual_inversion.py: save_weights``): ``{"emb_params": (n, dim)}`` for SD1/SD2, ``{"clip_l": (n, 768),
"clip_g": (n, 1280)}`` for SDXL (the keys are the family's ``ti_embedding_keys``), ``.safetensors`` with metadata or a
plain-dict ``.pt`` / ``.ckpt``; :mod:`library.text.textual_inversion` (gen_img, samples) and diffusers read them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from library.cli.problems import ConfigError
from library.families.base import Parts
from library.families.protocol import ModelFamily
from library.text.textual_inversion import expansions_of, read_embedding

# The textual-inversion paper's caption templates (sd-scripts' --use_object_template / --use_style_template).
OBJECT_TEMPLATES = tuple(
    t.replace("*", "{}")
    for t in (
        "a photo of a *", "a rendering of a *", "a cropped photo of the *", "the photo of a *",
        "a photo of a clean *", "a photo of a dirty *", "a dark photo of the *", "a photo of my *",
        "a photo of the cool *", "a close-up photo of a *", "a bright photo of the *", "a cropped photo of a *",
        "a photo of the *", "a good photo of the *", "a photo of one *", "a close-up photo of the *",
        "a rendition of the *", "a photo of the clean *", "a rendition of a *", "a photo of a nice *",
        "a good photo of a *", "a photo of the nice *", "a photo of the small *", "a photo of the weird *",
        "a photo of the large *", "a photo of a cool *", "a photo of a small *",
    )
)  # fmt: skip
STYLE_TEMPLATES = tuple(
    f"a {w} in the style of {{}}" if not w.startswith("the ") else f"{w} in the style of {{}}"
    for w in (
        "painting", "rendering", "cropped painting", "the painting", "clean painting", "dirty painting",
        "dark painting", "picture", "cool painting", "close-up painting", "bright painting", "cropped painting",
        "good painting", "close-up painting", "rendition", "nice painting", "small painting", "weird painting",
        "large painting",
    )
)  # fmt: skip


def add_textual_inversion_args(parser: argparse.ArgumentParser) -> None:
    """sd-scripts' train_textual_inversion.py flags (same names, defaults and meaning)."""
    g = parser.add_argument_group("textual inversion")
    g.add_argument("--token_string", type=str, default=None, help="the new token trained (must not be a known word)")
    g.add_argument("--init_word", type=str, default=None, help="word(s) whose vectors initialise the token (cycled)")
    g.add_argument("--num_vectors_per_token", type=int, default=1, help="vectors per token (tok, tok1, ...)")
    g.add_argument("--weights", type=str, default=None, help="embedding file to continue from (instead of init_word)")
    g.add_argument("--use_object_template", action="store_true", help="ignore captions; use 27 object templates")
    g.add_argument("--use_style_template", action="store_true", help="ignore captions; use 19 style templates")


@dataclass(frozen=True)
class TextualInversionConfig:
    """What train_textual_inversion.py trains (read by the recipe; the run layer only sees ``trains_text_encoder``)."""

    token_string: str
    init_word: str | None = None
    num_vectors_per_token: int = 1
    weights: str | None = None
    templates: tuple[str, ...] = ()
    trains_text_encoder = True  # gradients flow through the text encoders to the new rows
    trained_parts = ()  # only the new rows, a tensor of their own
    fused_backward_pass = False
    no_token_padding = False

    def resume_settings(self) -> dict[str, Any]:
        return {}  # the embeddings' shapes are checked when the state loads

    def with_text_cached(self) -> None:
        return None  # what trains in the text encoders was asked for

    def deepspeed_plugin(self, cfg: Any) -> None:
        return None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TextualInversionConfig:
        """Read and check the flags; raises one ``ValueError`` listing every problem."""
        problems = []
        token, n = args.token_string, args.num_vectors_per_token
        if not token or not token.strip() or len(token.split()) != 1:
            problems.append(f"--token_string {token!r}: give one new word without spaces (e.g. --token_string sks_cat)")
        if n is None or n < 1:
            problems.append(f"--num_vectors_per_token must be >= 1, got {n}")
        if args.weights is None and args.init_word is None:
            problems.append("--init_word is required (the word whose vectors start the token), or --weights FILE")
        if args.weights is not None and not Path(args.weights).is_file():
            problems.append(f"--weights {args.weights}: no such file")
        if args.use_object_template and args.use_style_template:
            problems.append("--use_object_template and --use_style_template exclude each other; choose one")
        if getattr(args, "cache_text_encoder_outputs", False):
            problems.append(
                "--cache_text_encoder_outputs cannot be used for textual inversion: the text encoders must run "
                "every step to train the new token"
            )
        if problems:
            raise ConfigError(problems, "textual-inversion options")
        templates = OBJECT_TEMPLATES if args.use_object_template else STYLE_TEMPLATES if args.use_style_template else ()
        return cls(token, args.init_word, n, args.weights, templates)

    def check_plan(self, plan: Any) -> list[str]:
        """Before the model loads: the notes on captions that lack the token (none with templates, which put it in
        every caption); raises ``ConfigError`` when no caption holds it (library/text/token_captions.py)."""
        from library.text.token_captions import check_captions

        return [] if self.templates else check_captions(plan, self.token_string)


@dataclass(frozen=True)
class EmbeddingSpec:
    token: str
    init_word: str
    num_vectors: int = 1


def add_embedding_args(parser: argparse.ArgumentParser) -> None:
    """Pivotal tuning in the adapter scripts: new token embeddings trained in the same run."""
    g = parser.add_argument_group("new token embeddings (pivotal tuning)")
    g.add_argument(
        "--embedding",
        action="append",
        default=None,
        metavar="TOKEN=INIT_WORD[:VECTORS]",
        help="also train a new token (repeatable), e.g. sks_cat=cat:2; file <output_name>_embeddings/<token>.<ext>",
    )
    g.add_argument(
        "--embedding_lr", type=float, default=None, help="lr of the new embeddings (default --learning_rate)"
    )
    g.add_argument(
        "--stop_embedding_training", type=int, default=None, help="keep the embeddings as they are after step N"
    )
    g.add_argument(
        "--bundle_embeddings",
        action="store_true",
        help="also write the embeddings into the adapter file as A1111 bundle_emb.* keys (diffusers rejects those)",
    )


@dataclass(frozen=True)
class EmbeddingsConfig:
    """Pivotal tuning: new tokens trained in an adapter run (``--embedding tok=init_word[:vectors]``, repeatable)."""

    specs: tuple[EmbeddingSpec, ...] = ()
    lr: float | None = None  # --embedding_lr (None: --learning_rate)
    stop_after: int | None = None  # --stop_embedding_training N: the rows stay as they were after step N
    bundle: bool = False  # --bundle_embeddings: also A1111's bundle_emb.* keys in the adapter file

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EmbeddingsConfig:
        """Read and check the flags; raises one ``ValueError`` listing every problem."""
        problems, specs = [], []
        for text in getattr(args, "embedding", None) or []:
            token, eq, rest = text.partition("=")
            word, colon, count = rest.rpartition(":") if ":" in rest else (rest, "", "1")
            if not eq or not token.strip() or len(token.split()) != 1 or not word.strip() or not count.isdigit():
                problems.append(f"--embedding {text!r}: expected TOKEN=INIT_WORD or TOKEN=INIT_WORD:VECTORS "
                                "(e.g. --embedding sks_cat=cat:2)")  # fmt: skip
            elif int(count) < 1:
                problems.append(f"--embedding {text!r}: the number of vectors must be >= 1")
            else:
                specs.append(EmbeddingSpec(token.strip(), word.strip(), int(count)))
        if len({s.token for s in specs}) != len(specs):
            problems.append("--embedding: each token may be given once")
        stop, lr, bundle = args.stop_embedding_training, args.embedding_lr, args.bundle_embeddings
        if not specs and (stop is not None or lr is not None or bundle):
            problems.append("--embedding_lr / --stop_embedding_training / --bundle_embeddings need --embedding")
        if stop is not None and stop < 1:
            problems.append(f"--stop_embedding_training must be >= 1, got {stop}")
        if lr is not None and lr <= 0:
            problems.append(f"--embedding_lr must be > 0, got {lr}")
        if specs and getattr(args, "cache_text_encoder_outputs", False):
            problems.append("--cache_text_encoder_outputs cannot be used with --embedding (the new tokens are "
                            "trained through the text encoders)")  # fmt: skip
        if problems:
            raise ConfigError(problems, "embedding options")
        return cls(tuple(specs), lr, stop, bool(bundle))

    def build(self, family: ModelFamily, parts: Parts) -> list[TokenEmbeddings]:
        """The embeddings, their tokens added to ``parts`` (errors name the token and the fix)."""
        return [
            TokenEmbeddings(family, parts, s.token, init_vectors(family, parts, s.token, s.num_vectors, s.init_word,
                                                                 None), s.init_word, self.stop_after)
            for s in self.specs
        ]  # fmt: skip


def caption_rewriter(
    embeddings: Sequence[TokenEmbeddings], templates: Sequence[str] = ()
) -> Callable[[list[str], torch.Generator | None], list[str]]:
    """captions -> captions for the text encoders: with ``templates`` each caption becomes a random template around
    the (first) token (drawn from the step's generator, so resume is exact); then every multi-vector token is
    spelled out (``tok`` -> ``tok tok1 ...``)."""

    def rewrite(captions: list[str], generator: torch.Generator | None) -> list[str]:
        if templates:
            picks = torch.randint(len(templates), (len(captions),), generator=generator).tolist()
            captions = [templates[i].format(embeddings[0].token) for i in picks]
        for emb in embeddings:
            captions = [emb.caption(c) for c in captions]
        return captions

    return rewrite


def token_names(token: str, count: int) -> list[str]:
    """sd-scripts' names of an n-vector token: ``tok``, ``tok1``, ..., ``tok{n-1}``."""
    return [token] + [f"{token}{i}" for i in range(1, count)]


def init_vectors(family: ModelFamily, parts: Parts, token: str, count: int, init_word: str | None, weights: str | None):
    """Initial (count, dim) rows per text encoder: from the ``weights`` file, else ``init_word``'s token vectors
    (cycled, sd-scripts). Raises ``ValueError`` naming the flag and the fix."""
    if weights:
        vectors = read_embedding(weights, family)
        if vectors[0].shape[0] != count:
            raise ValueError(
                f"--weights {weights}: holds {vectors[0].shape[0]} vector(s) per token, but "
                f"--num_vectors_per_token is {count}; set --num_vectors_per_token {vectors[0].shape[0]}"
            )
        return vectors
    out = []
    for tokenizer, encoder in zip(parts.tokenizers, parts.text_encoders):
        ids = tokenizer.encode(init_word or "", add_special_tokens=False)
        if not ids:
            raise ValueError(
                f"--init_word {init_word!r} for token {token!r}: tokenises to nothing; give a word that describes "
                "the concept (e.g. --init_word dog)"
            )
        table = encoder.get_input_embeddings().weight.detach()
        out.append(torch.stack([table[ids[j % len(ids)]] for j in range(count)]).float().cpu())
    return out


class TokenEmbeddings(nn.Module):
    """One new token (n vectors) in every tokenizer / text encoder of ``parts``; a :class:`library.run.trainable.Trainable`.

    ``rows[i]`` (n, dim_i) is what is trained for text encoder ``i``. Installing changes ``parts`` in place (tokens
    added, tables grown by n rows, a forward hook reading ``rows``); :meth:`remove` takes the hooks off.
    """

    kind = "embedding"
    modelspec_kind = "textual-inversion"
    gradient_sync = "manual"  # the rows are used inside the frozen text encoders: the trainer averages gradients
    sparse_gradients = False  # every trained tensor gets a gradient each step
    may_sit_out = True  # a batch without the token does not reach the rows: its step changes nothing

    def __init__(
        self,
        family: ModelFamily,
        parts: Parts,
        token: str,
        vectors: Sequence[Tensor],
        init_word: str | None = None,
        stop_after: int | None = None,
        names: Sequence[str] | None = None,
    ):
        super().__init__()
        self.family, self.token, self.init_word, self.stop_after = family, token, init_word, stop_after
        self.names = list(names) if names else token_names(token, vectors[0].shape[0])  # one per row
        self.rows = nn.ParameterList([nn.Parameter(v.detach().clone().float()) for v in vectors])
        if stop_after:  # resumable: the step count and the rows as they were when training stopped
            self.register_buffer("steps_done", torch.zeros((), dtype=torch.long))
            self.frozen = nn.ParameterList([nn.Parameter(torch.zeros_like(r), requires_grad=False) for r in self.rows])
        self.ids: list[list[int]] = []
        self._hooks = []
        self._install(parts)

    @property
    def num_vectors(self) -> int:
        return len(self.names)

    def _install(self, parts: Parts) -> None:
        for tokenizer in parts.tokenizers:  # check every tokenizer before changing any
            vocab = tokenizer.get_vocab()
            existing = [n for n in self.names if n in vocab or f"{n}</w>" in vocab]
            if existing:
                raise ValueError(
                    f"token {self.token!r}: {existing} already in the tokenizer's vocabulary, so it cannot be trained "
                    "as a new token; choose a string that is not a word (e.g. a made-up one like 'sks_cat')"
                )
        for i, (tokenizer, encoder) in enumerate(zip(parts.tokenizers, parts.text_encoders)):
            tokenizer.add_tokens(self.names)
            ids = tokenizer.convert_tokens_to_ids(self.names)
            old = encoder.get_input_embeddings()
            if ids != list(range(old.weight.shape[0], old.weight.shape[0] + len(ids))):
                raise ValueError(f"token {self.token!r}: the tokenizer gave ids {ids}, expected the next free rows")
            weight = torch.cat([old.weight.detach(), self.rows[i].detach().to(old.weight)])
            table = nn.Embedding.from_pretrained(weight, freeze=True, padding_idx=old.padding_idx)
            encoder.set_input_embeddings(table)
            encoder.config.vocab_size = weight.shape[0]
            self._hooks.append(table.register_forward_hook(self._hook(i, ids[0])))
            expansions_of(parts)[i][ids[0]] = list(ids)
            self.ids.append(list(ids))

    def _hook(self, index: int, first: int):
        def hook(module: nn.Module, inputs: tuple, output: Tensor) -> Tensor:
            ids = inputs[0]
            new = ids >= first
            if not bool(new.any()):
                return output
            rows = self.rows[index].to(output.device, output.dtype)
            trained = nn.functional.embedding((ids - first).clamp(min=0, max=len(self.names) - 1), rows)
            return torch.where(new.unsqueeze(-1), trained, output)

        return hook

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------------------------------ the Trainable seam
    caption_rewrite = None  # captions -> captions (templates; tok -> tok tok1 ...): set by the recipe

    def step_models(self, models: Any) -> Any:
        """The step's inputs with this token's caption rewrite (textual inversion), else unchanged."""
        if self.caption_rewrite is None:
            return models
        return dataclasses.replace(models, caption_rewrite=self.caption_rewrite)

    def set_training(self, mode: bool) -> None:
        """Nothing to switch: the rows have no dropout (the text encoders stay in eval mode, as loaded)."""

    def after_step(self) -> dict[str, float]:
        """The other rows are never touched; with ``stop_after`` N, the rows are kept as they were after step N."""
        if self.stop_after:
            self.steps_done += 1
            with torch.no_grad():
                for rows, frozen in zip(self.rows, self.frozen):
                    if int(self.steps_done) <= self.stop_after:
                        frozen.copy_(rows)
                    else:
                        rows.copy_(frozen)
        return {}

    def prepare(self, accelerator: Any) -> TokenEmbeddings:
        return self

    def param_groups(self, lr: float) -> list[dict]:
        return [{"params": list(self.rows), "lr": lr, "name": f"embedding {self.token}"}]

    def caption(self, text: str) -> str:
        """sd-scripts' replacement: ``tok`` -> ``tok tok1 ... tok{n-1}`` for a multi-vector token."""
        return text.replace(self.token, " ".join(self.names)) if self.num_vectors > 1 else text

    def state_dict_for_file(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        out = {}
        for key, rows in zip(self.family.ti_embedding_keys, self.rows):
            t = rows.detach().to("cpu")
            out[key] = t.to(dtype) if dtype is not None else t
        return out

    def bundle_tensors(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """A1111's ``bundle_emb.<token>.*`` keys for an adapter file (``string_to_param.*``; SDXL clip_l / clip_g)."""
        tensors = self.state_dict_for_file(dtype)
        if len(tensors) == 1:
            return {f"bundle_emb.{self.token}.string_to_param.*": next(iter(tensors.values()))}
        return {f"bundle_emb.{self.token}.{k}": v for k, v in tensors.items()}

    def metadata(self) -> dict[str, str]:
        meta = {"ss_token_string": self.token, "ss_num_vectors_per_token": str(self.num_vectors)}
        if self.init_word:
            meta["ss_init_word"] = self.init_word
        return meta

    def save(self, path: str | os.PathLike, metadata: dict[str, str] | None = None, dtype: Any = None) -> None:
        """The embedding file (.safetensors with metadata, or a plain-dict .pt / .ckpt), atomically."""
        from library.files.weights import save_state_dict

        meta = {**self.metadata(), **(metadata or {})}
        save_state_dict(self.state_dict_for_file(dtype), path, metadata=meta, wrap_ckpt=False)

    def save_extra(self, path: str | os.PathLike, metadata: dict[str, str] | None = None, dtype: Any = None) -> Path:
        """Pivotal tuning: this token's file for the adapter file ``path``: ``<stem>_embeddings/<token>.<ext>`` (named
        after the token, which A1111, ComfyUI and gen_img take from the file name)."""
        from library.run.run_files import embeddings_dir

        path = Path(path)
        out = embeddings_dir(path) / f"{self.token}{path.suffix}"
        out.parent.mkdir(parents=True, exist_ok=True)
        keep = {k: v for k, v in (metadata or {}).items() if k.startswith("ss_") and not k.startswith("ss_network")}
        self.save(out, metadata=keep, dtype=dtype)
        return out


def add_embeddings(run: Any, network: Any, groups: list[dict], cfg: EmbeddingsConfig, learning_rate: float):
    """Pivotal tuning: ``(trainable, optimizer groups)`` for ``network`` plus the new embeddings of ``cfg`` (the
    network alone when there are none). Captions spell out multi-vector tokens; samples use the new rows."""
    embeddings = cfg.build(run.family, run.parts)
    if not embeddings:
        return network, groups
    from library.run.trainable import TrainableSet

    for e in embeddings:
        e.to(device=run.accelerator.device, dtype=run.cfg.run.train_dtype)
        groups = groups + e.param_groups(cfg.lr or learning_rate)
    trainable = TrainableSet([network, *embeddings], bundle=cfg.bundle)
    trainable.caption_rewrite = caption_rewriter(embeddings)  # captions spell out the multi-vector tokens
    return trainable, groups
