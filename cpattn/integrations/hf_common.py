"""What :mod:`cpattn.integrations.hf` and its ``hf_generate`` and ``hf_trainer`` share: the ``"cpattn"``
attention implementation of ``transformers`` and its mask hook (:func:`register`), the active
ContextParallel (:func:`use`), the view of it each layer runs on (:func:`layer_context`), the generation
step in progress (:data:`GENERATION`), packed batches (:func:`packed`) and shifted labels. Users import
the public names from :mod:`cpattn.integrations.hf`, which re-exports them.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator

import torch

from ..api import ContextParallel
from ..core.masks import AndMask, DocumentMask, Mask, SlidingWindowMask
from ..core.masks import sliding_window as sliding_window_mask
from ..packing import documents_view, read_bounds, show_bounds

#: the ``attn_implementation`` name this module registers
NAME = "cpattn"
#: the label value the loss ignores (transformers' and torch's convention)
IGNORE_INDEX = -100

_ACTIVE: contextvars.ContextVar[ContextParallel | None] = contextvars.ContextVar("cpattn_hf_active", default=None)
#: the ContextParallel and ``position_ids`` tensor last found to agree: a model passes one tensor to all
#: its layers, so it is checked once per forward
_CHECKED_POSITIONS: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("cpattn_hf_checked_positions",
                                                                                  default=None)
#: the ContextParallel and ``cu_seq_lens_q`` tensor last found to be its documents
_CHECKED_CU: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("cpattn_hf_checked_cu", default=None)
#: the decoding or multi-turn prefill step of ``hf.generate`` in progress (``hf_generate``): while set, every
#: ``"cpattn"`` layer attends the sharded key/value cache through it
GENERATION: contextvars.ContextVar = contextvars.ContextVar("cpattn_hf_generation", default=None)

#: keyword arguments of transformers' attention functions that change the result and that cpattn does not
#: implement, with what to do instead
_PACKING = ("packed sequences are expressed with the mask: view, batch = cpattn.integrations.hf.packed(cp, batch) "
            "gives the step's view with their document mask")
_UNSUPPORTED_KWARGS = {
    "position_bias": "additive position biases are not supported",
    "cu_seq_lens_q": _PACKING,
    "cu_seq_lens_k": _PACKING,
    "seq_idx": _PACKING,
}
_PADDING_ADVICE = ("cpattn does not take padding masks: pack the sequences without padding and pass "
                   "ContextParallel(mask=cpattn.masks.document(lengths)), or drop attention_mask when every "
                   "token is real")


def register() -> None:
    """Register the ``"cpattn"`` attention implementation (and its mask hook) with ``transformers``.
    Idempotent; call it before building a model with ``attn_implementation="cpattn"``."""
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as exc:
        raise ImportError("cpattn.integrations.hf needs transformers 5.x: pip install 'cpattn[hf]'") from exc
    AttentionInterface.register(NAME, attention_forward)
    # Without a mask hook transformers would silently drop a 2-D padding mask for an unknown
    # implementation; the hook sees it and raises.
    AttentionMaskInterface.register(NAME, mask_hook)


@contextlib.contextmanager
def use(cp: ContextParallel) -> Iterator[ContextParallel]:
    """Make ``cp`` the ContextParallel of every ``"cpattn"`` attention layer called inside the block
    (this thread or task only; nestable: the innermost wins). Run the forward and the backward inside
    it (the backward needs it only when layers are recomputed, as with gradient checkpointing)."""
    if not isinstance(cp, ContextParallel):
        raise TypeError(f"use() takes a cpattn.ContextParallel, got {type(cp).__name__}")
    token = _ACTIVE.set(cp)
    try:
        yield cp
    finally:
        _ACTIVE.reset(token)


def active() -> ContextParallel | None:
    """The ContextParallel made active by the innermost :func:`use`, or None."""
    return _ACTIVE.get()


def _require_active(module: torch.nn.Module) -> ContextParallel:
    """The active ContextParallel, remembered on ``module``. A layer recomputed inside a backward
    (gradient checkpointing) on a thread that does not see :func:`use` (autograd's device threads, a
    backward run on another thread) gets the ContextParallel of its own last forward."""
    cp = _ACTIVE.get()
    ref = module.__dict__.get("_cpattn_context")
    if cp is not None:
        if ref is None or ref() is not cp:  # written when it changes (not a submodule, parameter or buffer)
            module.__dict__["_cpattn_context"] = weakref.ref(cp)
        return cp
    cp = ref() if ref is not None and torch._C._current_autograd_node() is not None else None
    if cp is None:
        raise RuntimeError(f"a model with attn_implementation={NAME!r} was called outside "
                           "cpattn.integrations.hf.use(cp): wrap the forward and backward in `with use(cp):`")
    return cp


def mask_hook(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
              mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs) -> None:
    """transformers' mask interface for ``"cpattn"``: no mask is built (the ContextParallel's mask rules),
    but a padding mask (a 2-D ``attention_mask`` with a 0) or extra mask functions of the model raise."""
    if kwargs.get("use_vmap"):  # transformers sets it exactly when the model adds or_/and_mask_function
        raise NotImplementedError(f"attn_implementation={NAME!r}: this model adds its own mask function (e.g. "
                                  "bidirectional attention over image tokens), which cpattn cannot honour; express "
                                  "the whole mask as a cpattn mask (cpattn.masks.from_mask_mod) if it is static")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(f"attn_implementation={NAME!r}: attention_mask has padding (zeros); {_PADDING_ADVICE}")


def _and_parts(mask: Mask) -> list[Mask]:
    """The masks ``mask`` is the intersection of (itself when it is no ``&``)."""
    if isinstance(mask, AndMask):
        return _and_parts(mask.a) + _and_parts(mask.b)
    return [mask]


def layer_context(cp: ContextParallel, module: torch.nn.Module, kwargs: dict) -> ContextParallel:
    """The ContextParallel a layer runs on, from its attention call's keyword arguments (``is_causal``,
    else the module's, and ``sliding_window``): ``cp`` when its mask is what the layer asks for, else the
    view of ``cp`` (``with_mask``, cached per window) whose mask adds the layer's sliding window, so models
    that alternate window and full layers (Gemma 3, gpt-oss, Mistral-style hybrids) run on one
    ContextParallel. Raises when the layer's causality disagrees with the mask, or when the mask already
    has a window and the layer asks for another or for none."""
    where = f"layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__})"
    is_causal, sliding_window = kwargs.get("is_causal"), kwargs.get("sliding_window")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    base = cp  # the active one: a per-step view (documents) keeps its mask, the layer adds its window
    if is_causal != base.mask.is_causal:
        kind = "causal" if is_causal else "bidirectional"
        raise ValueError(f"{where} is {kind} but the ContextParallel mask {base.mask.name!r} is "
                         f"{'causal' if base.mask.is_causal else 'not causal'}; build the ContextParallel with a "
                         f"{kind} mask")
    windows = [m.window for m in _and_parts(base.mask) if isinstance(m, SlidingWindowMask)]
    if sliding_window is None:
        if windows:
            raise ValueError(f"{where} has no sliding window but the ContextParallel mask {base.mask.name!r} has "
                             f"one ({windows[0]} tokens); build it without the window: each window layer gets "
                             "its own view of it")
        return base
    if sliding_window in windows:
        return base
    if windows:
        raise ValueError(f"{where} attends a sliding window of {sliding_window} tokens but the ContextParallel "
                         f"mask has a window of {windows[0]}; build it without a window "
                         "(e.g. mask='causal'): each window layer then gets its own view")
    return base.with_mask(base.mask & sliding_window_mask(sliding_window, causal=is_causal))


def _packed_by(cp: ContextParallel, cu_seq_lens) -> bool:
    """Whether ``cu_seq_lens`` (a packed batch's document boundaries, as transformers passes them) are the
    documents of ``cp``'s mask, the filler document of :func:`packed` aside. Checked once per tensor."""
    checked = _CHECKED_CU.get()
    if checked is not None and checked[0] is cp and checked[1] is cu_seq_lens:
        return True
    ends = [int(x) for x in cu_seq_lens][1:]
    docs = [m for m in _and_parts(cp.mask) if isinstance(m, DocumentMask)]
    ok = bool(docs) and list(docs[0]._end_list[:len(ends)]) == ends and \
        len(docs[0].lengths) - len(ends) in (0, 1) and bool(ends)
    if ok:
        _CHECKED_CU.set((cp, cu_seq_lens))
    return ok


def _check_positions(cp: ContextParallel, position_ids: torch.Tensor | None) -> None:
    """Raise unless ``position_ids`` ``[1 or b, local_len]`` hold each local token's global position
    (``cp.positions()``), or its position inside its document for document masks; padding tokens may
    hold anything."""
    checked = _CHECKED_POSITIONS.get()
    if position_ids is None or (checked is not None and checked[0] is cp and checked[1] is position_ids):
        return
    expected = cp.positions().to(position_ids.device)
    real = expected >= 0
    accepted = [expected]
    for part in _and_parts(cp.mask):
        if isinstance(part, DocumentMask):
            ends = torch.tensor(part.lengths, device=expected.device).cumsum(0)
            starts = ends - torch.tensor(part.lengths, device=expected.device)
            doc = torch.searchsorted(ends, expected.clamp(min=0), right=True).clamp(max=len(part.lengths) - 1)
            accepted.append(expected - starts[doc])
    if position_ids.shape[-1] == expected.shape[0]:
        for want in accepted:
            if bool(((position_ids == want) | ~real).all()):
                _CHECKED_POSITIONS.set((cp, position_ids))
                return
    raise ValueError(f"position_ids do not hold the tokens' global positions: pass position_ids=cp.positions()[None] "
                     f"(shape [1, {cp.local_len}]; padding tokens are -1 there, which rotary embeddings accept; "
                     "clamp(min=0) for learned position embeddings) with the inputs sharded by cp.shard(x, dim=1)")


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention function for ``"cpattn"``: local ``query [b, h, s, d]``, ``key, value
    [b, h_kv, s, d]`` (key/value heads not repeated) -> ``(out [b, s, h, d], None)`` through the active
    ContextParallel's ``attention``. ``scaling`` is the softmax scale."""
    cp = _require_active(module)
    if attention_mask is not None:
        raise ValueError(f"attn_implementation={NAME!r} got a prepared attention mask of shape "
                         f"{tuple(attention_mask.shape)}: cpattn applies the ContextParallel's mask and cannot honour "
                         f"custom masks; express it as a cpattn mask (cpattn.masks) instead. {_PADDING_ADVICE}")
    if dropout:
        raise NotImplementedError(f"attention dropout ({dropout}) is not supported by cpattn: set the config's "
                                  "attention_dropout to 0.0, or call model.eval()")
    for name, why in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None and not (name.startswith("cu_seq_lens") and _packed_by(cp, kwargs[name])):
            raise NotImplementedError(f"attn_implementation={NAME!r}: {name}: {why}")
    if kwargs.get("output_attentions"):
        raise NotImplementedError(f"attn_implementation={NAME!r} computes no attention weights: "
                                  "pass output_attentions=False")
    step = GENERATION.get()
    if step is not None:  # hf.generate's decoding or multi-turn prefill: the sharded cache attends
        return step.attention(module, query, key, value, scaling, kwargs), None
    if key.shape[2] != query.shape[2]:
        raise NotImplementedError(f"keys ({key.shape[2]} tokens) and queries ({query.shape[2]}) differ in length: "
                                  "a transformers key/value cache is not supported; pass use_cache=False, or "
                                  "generate with cpattn.integrations.hf.generate (a cache sharded over the group)")
    if query.shape[2] != cp.local_len:
        raise ValueError(f"the layer got {query.shape[2]} tokens but the ContextParallel holds {cp.local_len} per rank "
                         f"(seq_len={cp.seq_len}, padding included): pass inputs sharded by cp.shard(x, dim=1)")
    active = cp
    cp = layer_context(cp, module, kwargs)
    _check_positions(active if cp.layout == active.layout else cp, kwargs.get("position_ids"))
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))  # gpt-oss: one sink logit per query head
    out = cp.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), softmax_scale=scaling,
                       sinks=sinks, softcap=kwargs.get("softcap"))  # Gemma 2 soft-caps its scores
    return out, None


def packed(cp: ContextParallel, batch: dict, pad_id: int = 0) -> tuple[ContextParallel, dict]:
    """One step of packed documents, as transformers' ``DataCollatorWithFlattening`` makes them: ``batch``
    holds ``input_ids`` ``[1, n]`` and ``position_ids`` ``[1, n]`` restarting at 0 in each document (and
    usually ``labels``, -100 at each document's first token), ``n <= cp.seq_len``. Returns this step's
    view of ``cp`` (``with_mask``: the document mask of those lengths, with ``cp``'s window if it has
    one) and the batch filled up to ``seq_len`` with one more document of ``pad_id`` tokens whose labels
    are ignored (it attends only itself, so it changes nothing else). Reads the positions on the host
    once (:func:`cpattn.packing.documents_view` makes the view). ``cu_seq_lens_q/k`` and ``max_length_q/k``
    (``return_flash_attn_kwargs=True``, TRL's ``padding_free``) are checked against the positions and left
    out::

        view, batch = hf.packed(cp, collator(examples))
        with hf.use(view):
            logits = model(view.shard(batch["input_ids"]), position_ids=view.shard(batch["position_ids"]),
                           use_cache=False).logits
            hf.causal_lm_loss(logits, batch["labels"], view).backward()
    """
    base = cp.base
    ids, pos = batch.get("input_ids"), batch.get("position_ids")
    if not isinstance(ids, torch.Tensor) or not isinstance(pos, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 \
            or pos.shape != ids.shape:
        raise ValueError("packed: batch needs input_ids and position_ids of shape [1, n] (DataCollatorWithFlattening)")
    n = ids.shape[1]
    if n > base.seq_len:
        raise ValueError(f"packed: the batch holds {n} tokens, more than the ContextParallel's seq_len={base.seq_len}")
    values = pos[0].tolist()
    starts = [i for i, p in enumerate(values) if p == 0]
    if not starts or starts[0] != 0 or any(p != values[i - 1] + 1 for i, p in enumerate(values) if i and p):
        raise ValueError("packed: position_ids must restart at 0 at each document and count up inside it, e.g. "
                         "[0, 1, 2, 0, 1]")
    bounds = (*starts, n)
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if batch.get(key) is not None and read_bounds(batch[key], key) != bounds:
            raise ValueError(f"packed: {key} does not match the documents of position_ids: "
                             f"{show_bounds(read_bounds(batch[key], key))}, not {show_bounds(bounds)}")
    view = documents_view(base, bounds, "position_ids")
    fill = base.seq_len - n
    out = {"input_ids": torch.cat([ids, ids.new_full((1, fill), pad_id)], 1),
           "position_ids": torch.cat([pos, torch.arange(fill, dtype=pos.dtype, device=pos.device)[None]], 1)}
    labels = batch.get("labels")
    if labels is not None:
        out["labels"] = torch.cat([labels, labels.new_full((1, fill), IGNORE_INDEX)], 1)
    return view, out


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """``[b, S]`` labels of the full sequence -> the next token's label at each position (the last
    position gets :data:`IGNORE_INDEX`), as transformers' causal-LM loss shifts them."""
    ignore = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], ignore], dim=1)
