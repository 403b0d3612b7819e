"""The torch reference engine: load a built engine folder and run batched forwards.

Callers hand over whole token sequences (as TensorRT-LLM's Triton clients re-send them); the
engine keeps a prefix KV cache per slot and computes only the part it has not seen, the way
TensorRT-LLM's KV-cache block reuse does. A rejected draft is undone by the next call: its
common prefix with the slot's tokens is what stays valid.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from trtspec import console
from trtspec.device import check_dtype, resolve, uses_cpu_kernels
from trtspec.engines.manifest import Manifest, read_manifest
from trtspec.engines.torch import threads
from trtspec.engines.torch.compiled import (
    ProgramChoice,
    StepProgram,
    choose_program,
    compile_failure,
    compiles,
    program_timer,
    saved_folder,
    streamed_weights,
)
from trtspec.engines.torch.kernels import KernelChoice, choice_key, choose_kernels, one_row_form, timed_sizes
from trtspec.engines.torch.labels import LabelStore
from trtspec.engines.torch.model import TREE_ROWS, DecoderConfig, DecoderLM, KVCache, StepInputs, rope_tables, tree_layout
from trtspec.errors import EngineError, RequestError
from trtspec.tokens import check_token_ids

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
WEIGHTS = "model.safetensors"

# A batched forward pads every row to the row with the most new tokens, and a padded token
# costs what a real one does. Where the rows differ a lot (a new request's prefill beside
# decode steps; a batch of prompts of mixed lengths) the engine runs them as a few forwards of
# rows of similar length. A forward's own cost (every weight read once, a few hundred kernel
# calls) counts as FORWARD_ROWS tokens in that choice.
FORWARD_ROWS = 32


def forward_groups(news: list[int], forward_rows: int = FORWARD_ROWS) -> list[list[int]]:
    """The rows (indices into ``news``, each row's new-token count) of one step split into the
    forwards that compute the fewest tokens, padding included, each forward costing
    ``forward_rows`` tokens more: groups of consecutive rows by length, each in row order."""
    n = len(news)
    if n < 2 or n * max(news) - sum(news) <= forward_rows:  # a split cannot save a forward's cost
        return [list(range(n))]
    order = sorted(range(n), key=lambda i: -news[i])  # longest first: a group's first row sets its width
    best = [0] * (n + 1)  # best[j]: the least cost of the first j rows of ``order``
    cut = [0] * (n + 1)  # where the last group of that best starts
    for j in range(1, n + 1):
        best[j], cut[j] = min((best[i] + (j - i) * news[order[i]] + forward_rows, i) for i in range(j))
    groups, j = [], n
    while j > 0:
        groups.append(sorted(order[cut[j] : j]))
        j = cut[j]
    return groups[::-1]


@dataclass
class ForwardItem:
    """A sequence to run and how many of its last positions need logits.

    ``tree``: the last len(tree) tokens are a draft tree (speculative/tree.py), tree[i] the
    parent of node i (an earlier node, or -1: the token before the tree). Node i goes at
    position (tokens before the tree) - 1 + its depth and attends to everything before the
    tree and to its own ancestors only. The slot then holds the tokens before the tree plus
    the tree aside: a later sequence that continues along one of its paths reuses that path's
    K/V (moved into place); every other node is forgotten.
    """

    tokens: list[int]
    n_logits: int
    tree: tuple[int, ...] | list[int] | None = None


# Runs a batch of sequences and returns logits [n_logits, vocab] per item (TorchEngine.run).
RunFn = Callable[[list[ForwardItem]], list[torch.Tensor]]


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SlotPool:
    """Which tokens each KV slot holds, and which slot a sequence should use.

    A slot *continues* the sequence it holds when a new sequence keeps all of its cached
    tokens but at most the last ``rollback`` (draft tokens the target rejected): then it is
    that sequence coming back, and its K/V is reused. Any other sequence takes the least
    recently used slot, still reusing whatever prefix it shares with it. So a live sequence is
    never evicted by another that merely shares a prefix with it (a chat template's header),
    as long as there are as many slots as live sequences.
    """

    def __init__(self, slots: int, rollback: int = 0):
        self.tokens: list[list[int]] = [[] for _ in range(slots)]
        # Per slot: a draft tree scored after its tokens, (tree tokens, parents), whose K/V sit
        # in the cache rows right after them until a continuation settles it (TorchEngine).
        self.trees: list[tuple[list[int], list[int]] | None] = [None] * slots
        self.last_used = [0.0] * slots
        self.rollback = rollback

    def assign(self, batch: list[list[int]]) -> list[tuple[int, int]]:
        """(slot, reusable prefix length) per sequence, distinct slots within the batch."""
        taken: set[int] = set()
        out = []
        for seq in batch:
            best, best_len = -1, -1
            for s, cached in enumerate(self.tokens):
                if s in taken or not cached:
                    continue
                # A continuation keeps at least its first len(cached) - rollback tokens: one
                # list comparison rules out the rest (a batch of 128 rows that share a system
                # prompt would otherwise walk 128 x 128 common prefixes token by token a step).
                m = max(len(cached) - self.rollback, 1)
                if seq[:m] != cached[:m]:
                    continue
                n = common_prefix_len(seq, cached)
                if n > 0 and n >= len(cached) - self.rollback and n > best_len:
                    best, best_len = s, n  # the longest continuation
            if best < 0:  # a new sequence: the least recently used free slot
                best = min((s for s in range(len(self.tokens)) if s not in taken), key=lambda s: self.last_used[s])
                best_len = common_prefix_len(seq, self.tokens[best])
            taken.add(best)
            out.append((best, best_len))
        return out

    def forget(self) -> None:
        """Drop every cached prefix (the next call recomputes from position 0); a batch then
        takes slots 0..b-1 in order, as in a fresh pool (consecutive slots: no K/V gather)."""
        for s in range(len(self.tokens)):
            self.tokens[s] = []
            self.trees[s] = None
            self.last_used[s] = 0.0

    def truncate(self, slot: int, length: int) -> None:
        """Keep only the first ``length`` cached tokens of ``slot`` (the rest is being rewritten)."""
        del self.tokens[slot][length:]
        self.trees[slot] = None

    def commit(self, slot: int, tokens: list[int], tree: tuple[list[int], list[int]] | None = None) -> None:
        """The slot holds ``tokens`` (and, after them, the K/V of ``tree``: (tokens, parents))."""
        self.tokens[slot] = list(tokens)
        self.trees[slot] = tree
        self.last_used[slot] = time.monotonic()

    def continues(self, seq: list[int], n: int) -> bool:
        """``seq`` reuses at least its first ``n`` tokens here for sure: a slot holds them and at
        most ``rollback`` tokens more, so assign gives it that slot or a longer one (one list
        comparison a slot, no walk token by token)."""
        return n <= 0 or any(n <= len(cached) <= n + self.rollback and cached[:n] == seq[:n] for cached in self.tokens)

    def longest_prefix(self, seq: list[int]) -> tuple[int, int]:
        """(slot, length) of the longest prefix of ``seq`` a slot holds (length 0: none)."""
        lengths = [common_prefix_len(seq, cached) for cached in self.tokens]
        best = max(range(len(lengths)), key=lengths.__getitem__)
        return best, lengths[best]

    def tree_path(self, slot: int, seq: list[int]) -> list[int]:
        """The nodes of the slot's pending tree that ``seq`` follows past the slot's tokens
        (empty when the slot holds no tree or ``seq`` does not continue its tokens)."""
        tree, held = self.trees[slot], self.tokens[slot]
        if tree is None or len(seq) <= len(held) or seq[: len(held)] != held:
            return []
        toks, parents = tree
        path: list[int] = []
        node = -1
        for t in seq[len(held) :]:
            node = next((c for c, p in enumerate(parents) if p == node and toks[c] == t), -1)
            if node < 0:
                break
            path.append(node)
        return path


class TorchEngine:
    """One model, ``slots`` KV caches of ``max_seq_len`` positions; thread-safe run()."""

    def __init__(
        self,
        folder: Path,
        manifest: Manifest,
        model: DecoderLM,
        hf_config,
        slots: int,
        max_seq_len: int | None = None,
        device: torch.device | None = None,
    ):
        self.folder = folder
        # Where the weights, KV cache, features and RoPE tables live (trtspec/device.py decides);
        # run() still returns logits on the CPU, where the loop reads them.
        self.device = device or torch.device("cpu")
        self.manifest = manifest
        self.model = model
        self.config = model.cfg
        self.vocab_size = model.cfg.vocab_size
        # A caller that knows its sequences are short (distill) sizes the KV cache to them.
        self.max_seq_len = min(max_seq_len or manifest.limits["max_seq_len"], manifest.limits["max_seq_len"])
        self.max_batch_size = slots
        dtype = DTYPES[manifest.dtype]
        with self.device:  # the cache's buffers are made on the engine's device
            self.cache = KVCache(model.cfg, slots, self.max_seq_len + TREE_ROWS, dtype)
        self.cos, self.sin = (t.to(self.device) for t in rope_tables(hf_config, self.max_seq_len))
        # A sequence comes back with up to max_draft_len rejected drafts (+ the bonus) replaced.
        self.pool = SlotPool(slots, rollback=manifest.max_draft_len + 1)
        self._lock = threading.Lock()
        self.forwards = 0  # number of run() calls that computed something
        # Per item of the last run(): (tokens reused from the slot's cache, tokens the slot held
        # before): what KV-cache block counts are computed from (trtspec/cache.py kv_blocks).
        self.last_use: list[tuple[int, int]] = []
        self.last_slots: list[int] = []  # per item of the last run(): the slot it ran in
        # EAGLE-3: layer outputs kept per (slot, position) like K/V, so a head can read the
        # features of any cached prefix (capture_features turns it on).
        self.capture: tuple[int, ...] = ()
        self.features: torch.Tensor | None = None  # [slots, max_seq, len(capture) * hidden]
        # serve.capture: the top-k logits of every position a run() computed logits for, kept
        # per (slot, position) like the features (capture_labels turns it on; labels.py).
        self.labels: LabelStore | None = None
        self.kernels: KernelChoice | None = None  # how load() chose the Linear kernels
        # The whole step compiled (compiled.py), where load() measured it faster: per step kind.
        self.program: StepProgram | None = None
        self.programs = ProgramChoice("eager", "eager", "fallback", "not chosen")
        self.weight_bytes = 0  # weights one forward reads (load() counts them)
        self.forward_rows = FORWARD_ROWS  # a forward's own cost in tokens (forward_groups)

    @classmethod
    def load(
        cls,
        folder: Path,
        slots: int | None = None,
        max_seq_len: int | None = None,
        device: torch.device | str | None = None,
        warm: bool = False,
        compiled: bool = True,
    ) -> TorchEngine:
        """``device``: a torch.device, or a name trtspec/device.py resolves (None: cpu).
        ``compiled``: False keeps every step eager (no compiled program is measured or made). ``warm``:
        make every packed matmul shape now (warm_matmuls): what a long-lived server's engine does
        (the Triton engine model), so its memory stays flat; a one-shot command (verify, bench,
        distill) ends before the shapes it never meets matter, and does not pay for them."""
        from transformers import AutoConfig

        folder = Path(folder)
        manifest = read_manifest(folder)
        if manifest.backend != "torch":
            raise EngineError(f"{folder} holds a {manifest.backend} engine, not a torch engine")
        device = device if isinstance(device, torch.device) else resolve(device)
        check_dtype(device, manifest.dtype, f"{folder} ({manifest.role})")
        hf_config = AutoConfig.from_pretrained(folder)
        cfg = DecoderConfig.from_hf(hf_config)
        state = load_file(str(folder / WEIGHTS), device=str(device))
        model = DecoderLM.from_state_dict(cfg, state)
        model.fuse_projections()
        n = slots if slots is not None else manifest.limits["max_batch_size"]
        engine = cls(folder, manifest, model, hf_config, n, max_seq_len, device)
        # Counted before packing (a packed weight is opaque): what one decode step must read.
        # The embedding table is read one row a token; tied to the LM head, it is read whole there.
        engine.weight_bytes = sum(
            t.nbytes for name, t in model.named_parameters(remove_duplicate=False) if not name.startswith("model.embed_tokens")
        )
        # The Linear kernels: whichever is faster on this CPU, measured once per machine.
        if uses_cpu_kernels(device):
            streamed = streamed_weights(model)  # before the kernel choice re-lays them
            engine.kernels = choose_kernels(model, engine.cos, engine.sin, verify_tokens=manifest.max_draft_len + 1)
            if one_row_form(engine.kernels) == "panel":
                # the panel kernel streams a one-row step's weights itself, and then a decode step
                # and a verify step add each row's products alike: no streamed copies
                streamed = {}
            if compiled:
                engine.choose_program(streamed)
            else:
                engine.programs = ProgramChoice("eager", "eager", "forced", "this engine's caller runs it eager")
            if warm:
                engine.warm_matmuls()
                engine.warm_programs()
        else:
            engine.kernels = KernelChoice(
                "dense", "fallback", reason=f"{device}: PyTorch's own kernels (the CPU choice does not apply)"
            )
        return engine

    def choose_program(self, streamed: dict[str, torch.nn.Module]) -> None:
        """Eager or the compiled step (compiled.py) for each kind of step, as measured on this
        machine (cached per machine); ``streamed``: the Linears a one-row step may stream."""
        verify_tokens = self.manifest.max_draft_len + 1
        key = json.dumps(json.loads(choice_key(self.model, verify_tokens)) | {"layout": self.kernels.layout}, sort_keys=True)
        weights = self.manifest.files.get(WEIGHTS)
        saved_in = saved_folder(key + ",".join(sorted(streamed)), weights.sha256 if weights else "unknown")
        program = StepProgram(self.model, self.manifest.role, streamed, saved_in)
        sizes = timed_sizes(verify_tokens)
        self.programs = choose_program(key, program_timer(self.model, program, self.cos, self.sin, sizes))
        if self.programs.one != "compiled":
            program.streamed = {}  # the dense copies are not read: let them go
        if self.programs.any_compiled:
            self.program = program
        else:
            program.close()
        if self.programs.source == "fallback":
            console.info(f"{self.manifest.role}: the step runs eager: {self.programs.reason}")

    def warm_programs(self) -> None:
        """Compile now every kind of step a server meets (one row or several, of one token or
        several) at each thread count the governor compares (a program is compiled for one
        count: its loops split work by it), so that no request waits for a compile."""
        if self.program is None:
            return
        for _ in threads.governor().in_turn():
            for rows in range(1, min(self.max_batch_size, 2) + 1):
                # two new tokens a row (a prefill: one row's first chunk is causal), one on top
                # (a decode step), then two more (a verify step, or a prefill's later chunk)
                self.run([ForwardItem([1 + i] * 2, 2) for i in range(rows)])
                self.run([ForwardItem([1 + i] * 3, 1) for i in range(rows)])
                self.run([ForwardItem([1 + i] * 5, 2) for i in range(rows)])
                self.forget_prefixes()

    def warm_matmuls(self) -> int:
        """Every packed matmul shape a forward can meet, made at each thread count the governor
        compares (model.py warm_matmuls): a forward has at most max_batch_size x (max_seq_len +
        TREE_ROWS) rows, and the LM head at most max_batch_size x (TREE_ROWS + 1), a verified
        tree and its bonus per sequence. Returns the matmuls run."""
        rows, head_rows = self.max_batch_size * (self.max_seq_len + TREE_ROWS), self.max_batch_size * (TREE_ROWS + 1)
        return sum(self.model.warm_matmuls(rows, head_rows) for _ in threads.governor().in_turn())

    def step_bytes(self, context: int, rows: int = 1) -> tuple[int, int]:
        """(weight bytes, KV bytes) a decode step reads: every weight once, and per row the
        keys and values of ``context`` cached positions plus its new one, in every layer."""
        c = self.config
        kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * (context + 1) * self.cache.k[0].element_size()
        return self.weight_bytes, rows * kv

    def capture_features(self, layers: tuple[int, ...]) -> None:
        """Keep the outputs of ``layers`` (ascending ids) for every position computed from now on."""
        if list(layers) != sorted(set(layers)) or not all(0 <= i < self.config.num_layers for i in layers):
            raise EngineError(f"feature layers {list(layers)} must be distinct ascending ids in 0..{self.config.num_layers - 1}")
        with self._lock:
            self.capture = tuple(layers)
            width = len(layers) * self.config.hidden_size
            self.features = torch.zeros(
                (self.max_batch_size, self.max_seq_len + TREE_ROWS, width), dtype=self.cache.k[0].dtype, device=self.device
            )
            self.pool.forget()  # cached prefixes have no features yet

    def features_of(self, tokens: list[int], start: int, stop: int) -> torch.Tensor | None:
        """Captured features [stop - start, len(capture) * hidden] of positions start..stop-1 of
        ``tokens``, if a slot holds a prefix of ``tokens`` at least ``stop`` long (else None)."""
        if self.features is None:
            raise EngineError("this engine does not capture features; call capture_features first")
        with self._lock:
            slot = self._holding(tokens, stop)
            return None if slot is None else self.features[slot, start:stop].clone()

    def capture_labels(self, k: int, every_row: bool = True) -> None:
        """Keep the top ``k`` logits (ids and values) of every position a run() computes logits
        for from now on, per (slot, position) like the features (labels_of reads them).
        ``every_row`` False: only those of sequences starting with a prompt want_labels named."""
        with self._lock:
            rows = self.max_seq_len + TREE_ROWS
            self.labels = LabelStore(self.max_batch_size, rows, min(k, self.vocab_size), every_row)

    def want_labels(self, prompts: list[list[int]], wanted: bool = True) -> None:
        """Sequences starting with one of ``prompts`` get labels from now on; ``wanted`` False:
        no longer (one call each way per prompt, as with a count; labels kept stay)."""
        if self.labels is None:
            raise EngineError("this engine keeps no labels; call capture_labels first")
        with self._lock:
            (self.labels.want if wanted else self.labels.unwant)(prompts)

    def labels_of(self, tokens: list[int], start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(top ids [stop - start, k] int64, their logits [stop - start, k] float32) of positions
        start..stop-1 of ``tokens`` as the runs that computed them left them (ids -1: a position
        whose logits no run computed since its slot last held it), if a slot holds a prefix of
        ``tokens`` at least ``stop`` long (else None)."""
        if self.labels is None:
            raise EngineError("this engine keeps no labels; call capture_labels first")
        with self._lock:
            slot = self._holding(tokens, stop)
            return None if slot is None else self.labels.read(slot, start, stop)

    def _holding(self, tokens: list[int], stop: int) -> int | None:
        """The slot holding the first ``stop`` of ``tokens`` (a pending draft tree's path settled
        first), or None. Call with the lock held."""
        self._settle_trees([tokens[:stop]])
        for slot, cached in enumerate(self.pool.tokens):
            if len(cached) >= stop and common_prefix_len(tokens[:stop], cached) >= stop:
                return slot
        return None

    def forget_prefixes(self) -> None:
        """Empty the prefix cache, e.g. so a timed run cannot reuse another run's prefill."""
        with self._lock:
            self.pool.forget()

    def prefill_shared(self, prompts: list[list[int]]) -> None:
        """A fresh pool whose slot i holds prompts[i]'s K/V (and captured features), computed
        with each shared part once: the prefix every prompt starts with (a chat template's
        system prompt) in slot 0, copied into the others; then each distinct prompt's rest in
        its first slot, copied into the slots of the same prompt. A batch of those prompts in
        that order then takes slots 0..len-1 (no K/V gather) and computes one position each."""
        if not 1 <= len(prompts) <= self.max_batch_size or not all(prompts):
            raise RequestError(f"{len(prompts)} prompts (none empty) must fit the engine's {self.max_batch_size} slots")
        with self._lock:
            self.pool.forget()
            shared = prompts[0][: min(map(len, prompts))]
            for p in prompts[1:]:
                shared = shared[: common_prefix_len(shared, p)]
            if shared and len(prompts) > 1:
                self._run_locked([ForwardItem(list(shared), 1)])  # a fresh pool puts it in slot 0
                self._copy_slot(0, range(1, len(prompts)), len(shared))
            first = {}  # prompt -> its first slot
            for i, p in enumerate(prompts):
                first.setdefault(tuple(p), i)
            copies = [i for i, p in enumerate(prompts) if first[tuple(p)] != i]
            for i in copies:  # filled below; meanwhile no prompt computed now may take the slot
                self.pool.truncate(i, 0)
                self.pool.last_used[i] = math.inf
            # Each distinct prompt takes the first slot left that holds the shared prefix (or,
            # with none, the first free one): its own.
            self._run_locked([ForwardItem(list(p), 1) for i, p in enumerate(prompts) if first[tuple(p)] == i])
            for i in copies:
                self._copy_slot(first[tuple(prompts[i])], [i], len(prompts[i]))
            self.pool.last_used = [0.0] * len(self.pool.last_used)

    def _copy_slot(self, src: int, dst, n: int) -> None:
        """Slots ``dst`` hold the first ``n`` tokens of slot ``src``: its K/V and features copied."""
        dst = torch.tensor(list(dst), dtype=torch.long)
        if not len(dst):
            return
        for layer in range(len(self.cache.k)):
            self.cache.k[layer][dst, :, :n] = self.cache.k[layer][src : src + 1, :, :n]
            self.cache.v[layer][dst, :, :n] = self.cache.v[layer][src : src + 1, :, :n]
        if self.features is not None:
            self.features[dst, :n] = self.features[src : src + 1, :n]
        if self.labels is not None:
            self.labels.copy(src, dst, n)
        for d in dst.tolist():
            self.pool.commit(d, self.pool.tokens[src][:n])

    def kv_mismatch(self, source: TorchEngine) -> str | None:
        """Why this engine cannot take ``source``'s K/V (adopt), or None where it can: the same
        cache per layer (layers, KV heads, head_dim) and the same RoPE tables (keys are cached
        rotated). Captured features are not adopted: an engine that captures them cannot."""
        if source is self:
            return "an engine does not adopt its own K/V"
        if self.capture:
            return "this engine captures features (an EAGLE-3 target), which adopting would leave stale"
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            mine, theirs = getattr(self.config, name), getattr(source.config, name)
            if mine != theirs:
                return f"{name} {mine} differs from the source's {theirs}"
        n = min(len(self.cos), len(source.cos))
        for a, b in ((self.cos, source.cos), (self.sin, source.sin)):
            if not torch.equal(a[:n], b[:n].to(a.device)):
                return "the RoPE tables differ (rope_theta or scaling)"
        return None

    def adopt(self, source: TorchEngine, seqs: list[list[int]], min_gain: int = 0) -> list[int]:
        """Take ``source``'s K/V for the longest prefix of each of ``seqs`` that a source slot
        holds, where that prefix is more than ``min_gain`` tokens longer than what this engine
        could reuse itself: rows [0, n) of every layer are copied (converted to this cache's
        dtype) into the slot run() gives the sequence, which then computes only the rest. Per
        sequence, the tokens adopted (0: none). Call only where kv_mismatch(source) is None."""
        if source is self:
            raise EngineError("an engine does not adopt its own K/V")
        if not seqs or len(seqs) > self.max_batch_size:  # run() refuses the batch, with its reason
            return [0] * len(seqs)
        first, second = sorted((self._lock, source._lock), key=id)  # one order: no deadlock
        with first, second:
            if all(self.pool.continues(seq, len(seq) - min_gain) for seq in seqs):  # a decode step's usual case
                return [0] * len(seqs)
            if any(t is not None for t in self.pool.trees):
                self._settle_trees(seqs)  # what this engine reuses along its own draft tree
            adopted = []
            for seq, (slot, own) in zip(seqs, self.pool.assign(seqs)):
                src, n = source.pool.longest_prefix(seq)
                n = min(n, self.max_seq_len)
                if n - own <= min_gain:
                    adopted.append(0)
                    continue
                self.pool.truncate(slot, 0)  # until every row is copied the slot holds nothing
                if self.labels is not None:  # adopted rows come without their logits
                    self.labels.forget(slot, 0, n)
                for mine, theirs in ((self.cache.k, source.cache.k), (self.cache.v, source.cache.v)):
                    for dst, src_rows in zip(mine, theirs):  # each [slots, kv_heads, max_seq, head_dim]
                        dst[slot, :, :n].copy_(src_rows[src, :, :n])
                self.pool.commit(slot, seq[:n])
                adopted.append(n)
            return adopted

    def run(self, items: list[ForwardItem]) -> list[torch.Tensor]:
        """Logits [n_logits, vocab] (float32) for the last n_logits positions of each item."""
        if not items:
            return []
        if len(items) > self.max_batch_size:
            raise RequestError(
                f"batch of {len(items)} exceeds the engine's max_batch_size {self.max_batch_size}; send fewer sequences at once"
            )
        for it in items:
            if not 1 <= it.n_logits <= len(it.tokens):
                raise RequestError(f"n_logits {it.n_logits} not in 1..{len(it.tokens)}")
            if it.tree is not None:
                self._check_tree(it)
            elif len(it.tokens) > self.max_seq_len:
                raise RequestError(f"sequence of {len(it.tokens)} tokens exceeds max_seq_len {self.max_seq_len}")
            check_token_ids(it.tokens, self.vocab_size)
        with self._lock:
            return self._run_locked(items)

    def _check_tree(self, it: ForwardItem) -> None:
        tree = list(it.tree or ())
        if not 1 <= len(tree) < len(it.tokens):
            raise RequestError(f"a draft tree of {len(tree)} node(s) needs 1..{len(it.tokens) - 1} (a context token before it)")
        if it.n_logits > len(tree) + 1:
            raise RequestError(f"n_logits {it.n_logits} reaches before the tree's context token; at most {len(tree) + 1}")
        if len(tree) > TREE_ROWS:
            raise RequestError(f"a draft tree of {len(tree)} nodes; at most {TREE_ROWS}")
        try:
            depths, _ = tree_layout(tree)
        except ValueError as e:
            raise RequestError(f"malformed draft tree: {e}") from None
        if len(it.tokens) - len(tree) + max(depths) > self.max_seq_len:
            raise RequestError(
                f"{len(it.tokens) - len(tree)} tokens + a draft tree {max(depths)} deep exceed max_seq_len {self.max_seq_len}"
            )

    def _tree_kept(self, slot: int, it: ForwardItem, before: int) -> int:
        """How many of ``it``'s first tree nodes the slot holds already: its pending tree, scored
        after the same ``before`` tokens, when that tree is the start of this one."""
        pending = self.pool.trees[slot]
        if it.tree is None or pending is None or self.pool.tokens[slot] != it.tokens[:before]:
            return 0
        toks, parents = pending
        m = len(toks)
        if m > len(it.tree) or it.tokens[before : before + m] != toks or list(it.tree[:m]) != list(parents):
            return 0
        return m

    def _settle_trees(self, seqs: list[list[int]]) -> None:
        """Where a sequence continues along a path of a slot's pending draft tree, move that
        path's K/V (and features) into the rows right after the slot's tokens and hold them as
        a plain prefix; the tree's other nodes are forgotten (they are never attended again)."""
        for slot, tree in enumerate(self.pool.trees):
            if tree is None:
                continue
            for seq in seqs:
                path = self.pool.tree_path(slot, seq)
                if not path:
                    continue
                held = len(self.pool.tokens[slot])
                src = torch.tensor(path, device=self.device) + held  # the nodes' cache rows
                dst = slice(held, held + len(path))
                for k, v in zip(self.cache.k, self.cache.v):  # each [slots, kv_heads, max_seq, head_dim]
                    k[slot, :, dst] = k[slot, :, src]
                    v[slot, :, dst] = v[slot, :, src]
                if self.features is not None:
                    self.features[slot, dst] = self.features[slot, src]
                if self.labels is not None:
                    self.labels.move(slot, src, dst)
                self.pool.commit(slot, seq[: held + len(path)])
                break

    def _run_locked(self, items: list[ForwardItem]) -> list[torch.Tensor]:
        if any(t is not None for t in self.pool.trees):  # a tree item's own context may follow a path
            self._settle_trees([it.tokens[: len(it.tokens) - len(it.tree or ())] for it in items])
        assigned = self.pool.assign([it.tokens for it in items])
        self.last_use = [(reuse, len(self.pool.tokens[slot])) for slot, reuse in assigned]
        self.last_slots = [slot for slot, _ in assigned]
        starts = []
        for it, (slot, reuse) in zip(items, assigned):
            # Positions that need logits must be computed now, even if already cached. A tree's
            # nodes are no prefix of anything cached, except the first ones of a tree the slot
            # holds after the same tokens (a drafter growing a tree a depth at a time).
            before = len(it.tokens) - (len(it.tree) if it.tree is not None else 0)
            kept = self._tree_kept(slot, it, before)
            starts.append(
                min(reuse, len(it.tokens) - it.n_logits, before) if not kept else min(before + kept, len(it.tokens) - it.n_logits)
            )
        # K/V beyond each start is about to be overwritten: until the forward succeeds the slot
        # holds only the prefix, so a failed forward never leaves half-written K/V reusable.
        for it, (slot, _), start in zip(items, assigned, starts):
            self.pool.truncate(slot, start)
            if self.labels is not None:  # rows computed again hold no label until their logits are kept
                self.labels.forget(slot, start, len(it.tokens))
        news = [len(it.tokens) - start for it, start in zip(items, starts)]
        wanted: list[torch.Tensor] = [torch.empty(0)] * len(items)  # per item, its hidden rows that need logits
        # The thread count for this shape (rows, new tokens, keys attended), chosen from measured
        # forwards: fewer threads while a neighbour holds a core (threads.py).
        shape = (id(self), len(items), max(news).bit_length(), max(len(it.tokens) for it in items).bit_length())
        # a compiled program runs only at the counts it was compiled for: another count would
        # compile in the middle of a request (a load compiles every count: warm_programs)
        allowed = self.program.counts if self.program is not None and self.program.counts else None
        governed = threads.governor().forward(shape, compiles, allowed) if self.device.type == "cpu" else contextlib.nullcontext()
        with governed:
            for group in forward_groups(news, self.forward_rows):
                rows = self._forward([items[i] for i in group], [assigned[i] for i in group], [starts[i] for i in group])
                for i, hidden in zip(group, rows):
                    wanted[i] = hidden
            # Every row's positions that need logits go through the LM head in ONE call: the
            # head (vocab x hidden, the largest weight) is then read once a step, not once per row.
            heads = wanted[0] if len(wanted) == 1 else torch.cat(wanted)  # [rows, hidden]
            logits = self._compiled_or_eager(heads.shape[0], lambda forward: forward.logits(heads))
        if self.labels is not None:  # serve.capture: each item's rows that got logits
            rows = [(slot, len(it.tokens) - it.n_logits, it.n_logits) for it, (slot, _) in zip(items, assigned)]
            self.labels.keep(rows, logits, [it.tokens for it in items])
        logits = logits.cpu()  # where the loop reads it
        self.forwards += 1
        out = list(logits.split([it.n_logits for it in items]))  # per item [n_logits, vocab]
        for it, (slot, _) in zip(items, assigned):
            if it.tree is None:
                self.pool.commit(slot, it.tokens)
            else:  # the context as a prefix; the tree aside until a continuation settles it
                before = len(it.tokens) - len(it.tree)
                self.pool.commit(slot, it.tokens[:before], (it.tokens[before:], list(it.tree)))
        return out

    def _forward(self, items: list[ForwardItem], assigned, starts) -> list[torch.Tensor]:
        """One forward over ``items``: fills their K/V (and captured features); returns, per
        item, the final hidden states [n_logits, hidden] of its positions that need logits."""
        step = self._step_inputs(items, assigned, starts)
        captured: list[torch.Tensor] = []  # each [b, q, hidden]
        capture = (self.capture, captured) if self.capture else ()
        hidden = self._compiled_or_eager(
            step.tokens.numel(), lambda forward: forward.hidden_states(step, self.cos, self.sin, self.cache, *capture)
        )  # [b, q, hidden]
        if captured:
            feats = torch.cat(captured, dim=-1)  # [b, q, len(capture) * hidden]
            for row, (slot, start, n) in enumerate(step.rows):
                self.features[slot, start : start + n] = feats[row, :n]
        return [
            hidden[row, len(it.tokens) - start - it.n_logits : len(it.tokens) - start]
            for row, (it, start) in enumerate(zip(items, starts))
        ]

    def _compiled_or_eager(self, rows: int, call: Callable):
        """``call`` on the compiled program where it runs steps of ``rows`` rows, else on the
        model (eager). A compile that fails at run time (a kind first met here, a machine whose
        compiler broke) leaves the engine eager for good, said in one line; the step is run
        again eagerly, rewriting whatever K/V the failed attempt wrote."""
        if self.program is None or self.programs.path(rows) != "compiled":
            return call(self.model)
        try:
            return call(self.program)
        except Exception as err:  # inductor's errors have no common base class
            reason = compile_failure(err)
            self.programs = ProgramChoice("eager", "eager", "fallback", reason)
            self.program.close()
            self.program = None
            console.info(f"{self.manifest.role}: the step runs eager: {reason}")
            return call(self.model)

    def _step_inputs(self, items, assigned, starts) -> StepInputs:
        b = len(items)
        q = max(len(it.tokens) - s for it, s in zip(items, starts))
        tokens = torch.zeros((b, q), dtype=torch.long)
        positions = torch.zeros((b, q), dtype=torch.long)
        rows = []
        trees = []  # (row, tokens before the tree, first tree query, ancestor mask [n, n])
        for row, (it, start, (slot, _)) in enumerate(zip(items, starts, assigned)):
            new = it.tokens[start:]
            tokens[row, : len(new)] = torch.tensor(new, dtype=torch.long)
            positions[row, : len(new)] = torch.arange(start, start + len(new))
            if it.tree is not None:
                before = len(it.tokens) - len(it.tree)
                depths, ancestors = tree_layout(list(it.tree))
                first_node = max(start - before, 0)  # nodes before it are cached already
                first = max(before - start, 0)  # its row among this forward's tokens
                # Positions by depth: node i is where it would sit in its own path's sequence.
                at = torch.tensor(depths) + (before - 1)  # [n]
                positions[row, first : len(new)] = at[first_node:]
                trees.append((row, before, first, ancestors[first_node:], at))
            rows.append((slot, start, len(new)))
        # Filled on the CPU row by row, copied to the engine's device once (no copy on CPU).
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        span = max(start + n for _, start, n in rows)
        window = self.config.sliding_window
        mask = None
        # One sequence decoding one token attends to every cached position: no mask needed.
        if b > 1 or q > 1 or (window is not None and span > window):
            keys = torch.arange(span, device=self.device)  # [S]
            # Causal over each row's own positions; padding rows see key 0 only (no empty rows).
            allowed = keys.view(1, 1, span) <= positions.unsqueeze(-1)  # [b, q, S]
            if window is not None:
                allowed &= keys.view(1, 1, span) > positions.unsqueeze(-1) - window
            for row, before, first, ancestors, at in trees:
                # A tree node sees the context and its own ancestors' cache rows only (within
                # the window, by position: a node's is its depth's, not its cache row's).
                q, n = ancestors.shape  # the nodes computed now, all the tree's nodes
                at = at.to(self.device)
                mine = at[n - q :]  # [q]: the computed nodes' positions
                seen = ancestors.to(self.device)
                ctx = torch.ones((q, before), dtype=torch.bool, device=self.device)
                if window is not None:
                    ctx = keys[:before].view(1, before) > mine.view(q, 1) - window
                    seen = seen & (at.view(1, n) > mine.view(q, 1) - window)
                allowed[row, first : first + q] = False
                allowed[row, first : first + q, :before] = ctx
                allowed[row, first : first + q, before : before + n] = seen
            mask = allowed.unsqueeze(1)  # [b, 1, q, S]
        # One row from position 0, no tree, no window reached: its mask is exactly causal
        causal = mask is not None and b == 1 and not trees and starts[0] == 0 and (window is None or span <= window)
        return StepInputs(
            tokens=tokens,
            positions=positions,
            slots=torch.tensor([slot for slot, _ in assigned], dtype=torch.long, device=self.device),
            mask=mask,
            rows=rows,
            span=span,
            causal=causal,
        )
