"""The backend-agnostic VLM engine: image + question in, :class:`~edgevlm.types.Answer` out.

Pipeline of one request, the same for every model family (:mod:`edgevlm.runtime.models`): validate
-> the family's processor prepares the image (``Processor.prepare``: the checkpoint's own
preprocessing, or a resolution-ladder rung) -> render the chat template and tokenise the prompt,
the processor expanding each placeholder to its vision tokens -> backend ``encode_vision`` ->
``embed`` + ``position_ids`` + ``prefill`` -> sample -> ``decode`` one token at a time into the
static KV cache (at RoPE position slot + ``rope_delta``) until EOS, a stop string or the token
budget. Every stage is timed on the host clock after synchronising the device.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Generator, Hashable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from edgevlm.config_runtime import backend_settings_error
from edgevlm.errors import (
    InvalidImageError,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
    StreamNotEndedError,
)
from edgevlm.protocol import check_prompt
from edgevlm.runtime.backends import Backend, decode_tokens, load_backend
from edgevlm.runtime.loader import parse_dtype, read_model_files
from edgevlm.runtime.models.base import VisionInput
from edgevlm.runtime.preprocess import CLIP_MEAN, CLIP_STD, preprocess
from edgevlm.runtime.sampling import SamplingParams, TextAssembler, make_generator, select_token
from edgevlm.runtime.tokenizer import IncrementalDecoder, VLMTokenizer
from edgevlm.runtime.vision_cache import VisionCache, VisionTrunk, content_key
from edgevlm.types import (
    MAX_RESOLUTION_PX,
    Answer,
    OperatingPoint,
    Stats,
    asks_adaptive_vision,
    plain_scalar,
    vision_items_error,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_SEQ_LEN = 4096


#: Frames one request may send to a video-capable family (each costs vision tokens and encoder time).
MAX_VIDEO_FRAMES = 64


def _ms(t0: float, t1: float) -> float:
    return (t1 - t0) * 1e3


class Stream:
    """Iterator over the text deltas of one generation; :attr:`answer` once it is exhausted.

    ``for delta in stream: ...`` then ``stream.answer``: the deltas concatenate to ``answer.text``."""

    def __init__(self, gen: Generator[str, None, Answer]) -> None:
        self._gen = gen
        self._answer: Answer | None = None
        self._no_answer = ""  # why there will be none: closed early, or the iteration raised

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> str:
        try:
            return next(self._gen)
        except StopIteration as done:
            if self._answer is None:
                self._answer = done.value
            raise
        except BaseException as exc:
            self._no_answer = self._no_answer or f"its iteration raised {type(exc).__name__}"
            raise

    def close(self) -> None:
        """Stop generating early (releases the engine); the stream then has no :attr:`answer`."""
        if self._answer is None:
            self._no_answer = self._no_answer or "it was closed before it ended"
        self._gen.close()

    @property
    def answer(self) -> Answer:
        """The complete :class:`Answer`, once the iteration has ended (no answer is generated here: reading it
        never consumes deltas).

        Raises:
            StreamNotEndedError: (a ``RuntimeError``) the stream has not ended yet (iterate it to the end
                first), was closed before it ended, or its iteration raised.
        """
        if self._answer is not None:
            return self._answer
        if self._no_answer:
            raise StreamNotEndedError(f"the stream has no answer: {self._no_answer}")
        raise StreamNotEndedError(
            "the stream has not ended: iterate it to the end before reading .answer "
            "(Engine.ask returns the answer at once)"
        )


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request (:meth:`Engine.prepare`): ``ids`` are the prompt's token ids with
    ``n_vision`` vision placeholders for ``vision`` (the preprocessed image); ``resolution_px`` is
    the operating point's rung, or the tower's ``image_size`` when the checkpoint's own
    preprocessing ran (no rung asked for)."""

    operating_point: OperatingPoint
    params: SamplingParams
    resolution_px: int
    n_vision: int
    ids: list[int]
    vision: VisionInput | None = None
    preprocess_ms: float = 0.0
    vision_key: Hashable | None = None  # the vision cache's key (None: not cached)
    vision_trunk: bool = False  # the key holds a VisionTrunk (an exit_threshold point), not vision tokens


PROMPT_IDS_CACHE_SIZE = 1024
"""Prompts whose token ids :class:`Engine` remembers (LRU; see ``Engine._prompt_ids``)."""


class Engine:
    """A loaded VLM. Use :meth:`load`; calls are serialised by an internal lock.

    Attributes:
        family: the model family (:class:`~edgevlm.runtime.models.base.ModelFamily`).
        processor: the family's processor (preprocessing and prompt expansion).
        resolution_ladder: input resolutions (longer side, px) the model is meant to run at,
            from ``config.json``'s ``edgevlm.resolution_ladder`` (default ``[vision image_size]``).
        patch_size_px: the vision encoder's patch size; input sides are multiples of it.
        device, dtype, backend_name, model_dir: where and how the model runs.
        max_seq_len: KV cache capacity (vision + prompt + generated tokens).
    """

    def __init__(self, backend: Backend, tokenizer: VLMTokenizer, files, eos_token_ids: list[int]) -> None:
        cfg = files.config
        self.backend = backend
        self.tokenizer = tokenizer
        self.config = cfg
        self.family = files.family
        self.processor = files.family.make_processor(files)
        self.model_dir: Path = files.model_dir
        self.backend_name: str = backend.name
        self.device: str = str(backend.device)
        self.dtype: torch.dtype = backend.dtype
        self.resolution_ladder: list[int] = list(cfg.resolution_ladder)
        vision = getattr(cfg, "vision", None)  # families without a fixed tower size fall back to the ladder
        self.patch_size_px: int = int(getattr(vision, "patch_size", 0) or 1)
        self.image_size_px: int = int(getattr(vision, "image_size", 0) or max(self.resolution_ladder or [448]))
        self.image_mean = getattr(self.processor, "image_mean", None) or files.image_mean or CLIP_MEAN
        self.image_std = getattr(self.processor, "image_std", None) or files.image_std or CLIP_STD
        self.eos_token_ids = frozenset(eos_token_ids)
        self._lock = threading.Lock()
        self._owner: int | None = None  # thread id of the request holding the engine
        self.vision_cache: VisionCache | None = None
        """Per-frame vision features (:meth:`set_vision_cache`); None = off."""
        self._ids_cache: OrderedDict[tuple, tuple[int, ...]] = OrderedDict()  # see _prompt_ids
        self._ids_lock = threading.Lock()  # prepare() runs on several daemon threads

    def set_vision_cache(self, budget_mb: float | None) -> None:
        """Cache vision features per (frame, operating point) within ``budget_mb`` MiB (LRU), so that
        several questions about one frame run the vision encoder once; None or 0 turns it off. A
        frame is identified by the ``vision_key`` given to :meth:`ask` (e.g. a source's
        ``(name, seq)``) or else by the content hash of its pixels. Points whose vision depends on
        the question (``exit_threshold``) keep the frame's encoder walk instead (a
        :class:`~edgevlm.runtime.vision_cache.VisionTrunk`: one image, no pruning, the torch
        backend): the next question's exit heads read the kept blocks and only blocks past them
        run. Families whose encoder leaves state for the prefill (``family.vision_state_free``
        False: Qwen3-VL) are not cached.

        Raises:
            InvalidRequestError: ``budget_mb`` is not a number >= 0.
        """
        if budget_mb is None or budget_mb == 0:
            self.vision_cache = None
            return
        if isinstance(budget_mb, bool) or not isinstance(budget_mb, int | float) or not budget_mb > 0 \
                or budget_mb == float("inf"):
            raise InvalidRequestError(f"vision cache budget must be a number of MiB >= 0, got {budget_mb!r}")
        self.vision_cache = VisionCache(max(1, int(budget_mb * 2**20)))

    @property
    def max_seq_len(self) -> int:
        return self.backend.max_seq_len

    @classmethod
    def load(cls, path: str | Path | None = None, *, device: str = "cpu", dtype=None, backend: str = "torch",
             max_seq_len: int | None = None, backend_options: dict | None = None,
             vision_cache_mb: float | None = None) -> Engine:
        """Load a checkpoint folder of any registered model family (None = the shipped demo model).

        Args:
            device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
            dtype: torch dtype or name; None = float32 on CPU, bfloat16 on CUDA.
            backend: inference backend name (see :data:`edgevlm.runtime.backends.BACKENDS`).
            max_seq_len: KV cache positions; None = ``min(max_position_embeddings, 4096)`` (and
                within a Mistral ``sliding_window``).
            backend_options: backend-specific keyword arguments (torch: ``cuda_graphs``,
                ``kv_cache_dtype``, ``max_batch_size``, ``fused_vision_stem``; see
                :mod:`edgevlm.runtime.backends.torch_backend`).
            vision_cache_mb: per-frame vision feature cache budget in MiB (None = off; see
                :meth:`set_vision_cache`).
        Raises:
            ModelLoadError: bad folder/files, device unavailable, backend dependencies missing, not
                enough memory for the weights and the KV cache (``max_seq_len``).
            InvalidRequestError: bad ``device``/``dtype``/``backend``/``max_seq_len`` argument, or a
                device / dtype the backend does not run (:func:`edgevlm.config_runtime.backend_settings_error`).
        """
        if path is None:
            from edgevlm.runtime.demo import model_dir

            path = model_dir()
        try:
            if not isinstance(device, str | torch.device):
                raise TypeError(type(device).__name__)
            dev = torch.device(device)
        except (RuntimeError, TypeError):  # torch's own message lists every device type it knows, over lines
            raise InvalidRequestError(f"bad device {device!r}: expected 'cpu', 'cuda' or 'cuda:N'") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
        if dev.type not in ("cpu", "cuda"):
            raise InvalidRequestError(f"unsupported device {device!r} (cpu or cuda)")
        try:
            torch_dtype = parse_dtype(dtype, dev)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from exc
        refused = backend_settings_error(str(backend), str(dev), None if dtype is None else str(torch_dtype)[len("torch."):])
        if refused is not None:
            raise InvalidRequestError("{}: {}".format(*refused))
        files = read_model_files(path)
        tokenizer = VLMTokenizer.from_dir(files.model_dir, files.config.image_token_id, family=files.family.name)
        if max_seq_len is None:
            tc = files.config.text
            max_seq_len = min(tc.max_position_embeddings, DEFAULT_MAX_SEQ_LEN, tc.sliding_window or DEFAULT_MAX_SEQ_LEN)
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 2:
            raise InvalidRequestError(f"max_seq_len must be an integer >= 2, got {max_seq_len!r}")
        eos = list(files.eos_token_ids)
        eos_from_tokenizer = tokenizer.token_id(tokenizer.eos_token)
        if eos_from_tokenizer is not None and eos_from_tokenizer not in eos:
            eos.append(eos_from_tokenizer)
        try:
            be = load_backend(backend, files, device=dev, dtype=torch_dtype, max_seq_len=max_seq_len,
                              **(backend_options or {}))
        except RuntimeError as exc:  # torch.OutOfMemoryError is one; the CPU allocator's is a plain RuntimeError
            if not (isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc)
                    or "out of memory" in str(exc)):
                raise
            raise ModelLoadError(f"{files.model_dir}: not enough memory on {dev} for the weights and a KV cache of "
                                 f"max_seq_len={max_seq_len} positions (give a smaller max_seq_len)") from None
        engine = cls(be, tokenizer, files, eos)
        engine.set_vision_cache(vision_cache_mb)
        return engine

    # ---- requests ----------------------------------------------------------------------------
    def ask(self, image: np.ndarray | Sequence[np.ndarray], prompt: str, *, max_new_tokens: int = 64,
            temperature: float = 0.0, top_p: float = 1.0, stop: list[str] | None = None, seed: int | None = None,
            operating_point: OperatingPoint | None = None,
            frame_timestamps_s: Sequence[float] | None = None, vision_key: Hashable | None = None) -> Answer:
        """Answer ``prompt`` about ``image``: one ``(H, W, 3)`` uint8 RGB array, or a list of them
        (several recent frames of one source, oldest first). A list goes to a video-capable family
        (``family.supports_video``: Qwen2.5-VL, Qwen3-VL) as one video whose frame capture times are
        ``frame_timestamps_s`` (seconds, increasing; None = the family's default frame rate), and to
        other families as several images, up to ``family.max_images``; a list of one frame is one
        image. ``vision_key``: identifies the frame(s) for the vision cache (:meth:`set_vision_cache`;
        default: the pixels' content hash).

        Raises:
            InvalidImageError: an image is not an ``(H, W, 3)`` uint8 array.
            InvalidRequestError: bad prompt (not a string; empty or only whitespace: ``prompt: must hold a
                question ...``, the wire's rule, :func:`edgevlm.protocol.check_prompt`) or knobs, more frames
                than the model takes (the message names the limit; details ``reason: too_many_frames``,
                ``frames``, ``max_frames``), bad ``frame_timestamps_s``, or prompt + vision tokens do not fit
                the KV cache.
        """
        stream = self.stream(image, prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                             top_p=top_p, stop=stop, seed=seed, operating_point=operating_point,
                             frame_timestamps_s=frame_timestamps_s, vision_key=vision_key)
        for _ in stream:
            pass
        return stream.answer

    def stream(self, image: np.ndarray | Sequence[np.ndarray], prompt: str, *, max_new_tokens: int = 64,
               temperature: float = 0.0, top_p: float = 1.0, stop: list[str] | None = None,
               seed: int | None = None, operating_point: OperatingPoint | None = None,
               frame_timestamps_s: Sequence[float] | None = None, vision_key: Hashable | None = None) -> Stream:
        """Like :meth:`ask`, but returns a :class:`Stream` of text deltas. Arguments are validated
        here, before the first delta; the deltas concatenate to ``stream.answer.text``. The engine
        is held from the first ``next()`` until the stream is exhausted or closed (its timings
        include the consumer's time between deltas); a second request from the same thread while
        a stream is open raises InvalidRequestError."""
        t_start = time.perf_counter()
        p = self.prepare(image, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                         stop=stop, seed=seed, operating_point=operating_point,
                         frame_timestamps_s=frame_timestamps_s, vision_key=vision_key)
        return Stream(self._generate(p, t_start))

    def prepare(self, image: np.ndarray | Sequence[np.ndarray], prompt: str, *, max_new_tokens: int = 64,
                temperature: float = 0.0, top_p: float = 1.0, stop: list[str] | None = None,
                seed: int | None = None, operating_point: OperatingPoint | None = None,
                frame_timestamps_s: Sequence[float] | None = None,
                vision_key: Hashable | None = None, uint8_pixels: bool = False) -> PreparedRequest:
        """Validate a request and tokenise its prompt (what :meth:`stream` does before generating;
        also used by the daemon's batch worker): returns the operating point, sampling parameters,
        resolution rung (px), vision-token count, prompt ids (vision placeholders included) and the
        preprocessed image(s). ``image`` / ``frame_timestamps_s``: as in :meth:`ask`.
        ``uint8_pixels``: for the batched encoder (:mod:`edgevlm.runtime.batching`), a family with
        LLaVA's pixel path leaves one image at a plain point (no early exit or pruning) resized but
        not normalised, ``(1, H, W, 3)`` uint8 (normalised on the device with :attr:`image_mean` /
        :attr:`image_std`); ``ask`` never asks. The batched encoder does not read the vision cache, so
        with ``uint8_pixels`` no ``vision_key`` is made (no hash of the pixels).

        Raises:
            InvalidImageError: an image is not an ``(H, W, 3)`` uint8 array, or the family cannot
                resize it.
            InvalidRequestError: bad prompt/knobs/frames; :class:`~edgevlm.errors.PromptTooLongError`
                when prompt + vision tokens do not fit the KV cache.
        """
        op = self._check_operating_point(operating_point)
        images, video, video_ts = self._vision_items(image, frame_timestamps_s)
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"prompt must be a string, got {type(prompt).__name__}")
        try:  # the wire's rule (Request.prompt): the same inputs refused, with the same message
            check_prompt(prompt)
        except ValueError as exc:
            raise InvalidRequestError(f"prompt: {exc}", details={"path": "prompt"}) from None
        max_new_tokens, temperature, top_p, seed = map(plain_scalar, (max_new_tokens, temperature, top_p, seed))
        if op.max_new_tokens is not None and isinstance(max_new_tokens, int):
            max_new_tokens = min(max_new_tokens, op.max_new_tokens)
        params = SamplingParams.validate(max_new_tokens, temperature, top_p, stop, seed)
        t0 = time.perf_counter()
        if video is None and uint8_pixels and self.family.batched_pixels and len(images) == 1 and not asks_adaptive_vision(op):
            vision = self.processor.prepare(images, resolution_px=op.resolution_px, uint8_pixels=True)
        elif video is None:
            vision = self.processor.prepare(images, resolution_px=op.resolution_px)
        else:
            vision = self.processor.prepare([], resolution_px=op.resolution_px, video=video,
                                            video_timestamps_s=video_ts)
        preprocess_ms = _ms(t0, time.perf_counter())
        refusal = vision_items_error(op, vision.kinds)  # several items, or a video pruned
        if refusal is not None:
            raise InvalidRequestError(f"operating point {op.name!r}: {refusal}")
        n_vision = self._adaptive_vision_tokens(vision, op)
        in_prompt = vision if n_vision == vision.num_tokens else replace(vision, tokens_per_item=[n_vision])
        ids = self._prompt_ids(prompt, in_prompt)
        if len(ids) >= self.max_seq_len:
            th, tw = vision.input_sizes_px[0] if vision.input_sizes_px else (0, 0)
            raise PromptTooLongError(
                f"prompt is {len(ids)} tokens ({len(ids) - n_vision} text + {n_vision} vision at {tw}x{th} px); "
                f"the KV cache holds {self.max_seq_len} positions",
                tokens=len(ids), capacity=self.max_seq_len, vision_tokens=n_vision,
            )
        key = None
        # an exit_threshold point's tokens depend on the question, its encoder blocks do not: the frame's
        # walk is kept instead (VisionTrunk: one image, no pruning, a backend that takes one)
        trunk = op.exit_threshold is not None and op.keep_ratio in (None, 1.0) \
            and len(vision.tokens_per_item) == 1 and getattr(self.backend, "vision_trunks", False)
        if self.vision_cache is not None and not uint8_pixels and self.family.vision_state_free \
                and (op.exit_threshold is None or trunk):
            frame_id = vision_key if vision_key is not None else content_key(
                images + (video or []), tuple(video_ts) if video_ts is not None else None)
            key = (frame_id, tuple(vision.kinds), op.resolution_px,
                   *(("trunk",) if trunk else (op.exit_layer, op.keep_ratio)))
        return PreparedRequest(op, params, op.resolution_px or self.image_size_px, n_vision, ids, vision,
                               preprocess_ms, key, key is not None and trunk)

    def _prompt_ids(self, prompt: str, vision: VisionInput) -> list[int]:
        """``tokenizer.encode_request``'s ids, remembered for a family whose expansion is a function of
        the prompt and the vision-token counts alone (``batched_pixels``: LLaVA's image runs), the
        last :data:`PROMPT_IDS_CACHE_SIZE` of them that fit the KV cache (a longer prompt, which
        :meth:`prepare` refuses, is not kept: each entry stays below ``max_seq_len`` ids): a robot
        asks the same few questions, and the chat template's render + tokenisation is the costliest
        pure-Python step of a request."""
        if not (self.family.batched_pixels and vision.kinds and all(k == "image" for k in vision.kinds)):
            return self.tokenizer.encode_request(prompt, vision, self.processor)
        key = (prompt, tuple(vision.tokens_per_item))
        with self._ids_lock:
            hit = self._ids_cache.get(key)
            if hit is not None:
                self._ids_cache.move_to_end(key)
                return list(hit)
        ids = self.tokenizer.encode_request(prompt, vision, self.processor)  # InvalidRequestError: not cached
        if len(ids) >= self.max_seq_len:  # refused by prepare: kept out, so an entry's size is bounded by the cache
            return ids
        with self._ids_lock:
            self._ids_cache[key] = tuple(ids)
            if len(self._ids_cache) > PROMPT_IDS_CACHE_SIZE:
                self._ids_cache.popitem(last=False)
        return ids

    def warmup(self, resolutions: list[int] | None = None) -> None:
        """Run one 2-token request per rung (default: the resolution ladder), so that the first real
        request does not pay one-time kernel/allocator set-up."""
        image = np.full((self.image_size_px, self.image_size_px, 3), 128, np.uint8)
        for r in resolutions or self.resolution_ladder:
            self.ask(image, "describe", max_new_tokens=2,
                     operating_point=OperatingPoint(name="warmup", resolution_px=r))

    # ---- early exit, token pruning, exit classifier (edgevlm.runtime.exits / .pruning) ------------
    @property
    def exit_points(self) -> list[int]:
        """Vision blocks after which this model can exit early ([] without exit heads)."""
        heads = getattr(self.backend, "exit_heads", None)
        return heads.exit_blocks if heads is not None else []

    @property
    def no_exit_heads_reason(self) -> str:
        """Why this model runs no early exit (one line): a backend that runs none (ONNX Runtime,
        TensorRT: whatever the folder holds), no ``exits.json``, or heads calibrated for other
        weights (their ``weights_fingerprint`` differs; logged at load, not used)."""
        from edgevlm.runtime.exits import has_exit_heads

        if not hasattr(self.backend, "exit_heads"):
            return f"backend {self.backend_name!r} does not support early exit (the torch backend does)"
        if has_exit_heads(self.model_dir):
            return (f"the exit heads in {self.model_dir} were calibrated for other weights and are not used "
                    "(rerun `edgevlm calibrate`)")
        return "this model has no exit heads (run `edgevlm calibrate` on it)"

    @property
    def labels(self) -> list[str]:
        """Closed-set labels of the exit classifier ([] without one)."""
        heads = getattr(self.backend, "exit_heads", None)
        return heads.labels if heads is not None else []

    def _adaptive_vision_tokens(self, vision: VisionInput, op: OperatingPoint) -> int:
        """Vision tokens of ``vision`` after ``op.keep_ratio`` pruning; checks ``op``'s exit fields
        against the model's exit points. Raises InvalidRequestError for knobs this model/backend
        cannot run."""
        from edgevlm.runtime.pruning import pruned_count, pruned_tokens_per_item
        from edgevlm.runtime.vision import exit_plan

        n_vision = vision.num_tokens
        if asks_adaptive_vision(op) and not self.family.adaptive_vision:
            raise InvalidRequestError(f"operating point {op.name!r}: early exit and token pruning are not "
                                      f"supported for the {self.family.name} family")
        if op.exit_layer is not None or op.exit_threshold is not None:
            try:
                exit_plan(self.exit_points, self.config.exit_geometry.vision_blocks, op.exit_layer, op.exit_threshold)
            except ValueError as exc:
                if not hasattr(self.backend, "exit_heads"):
                    raise InvalidRequestError(f"backend {self.backend_name!r} does not support early exit") from None
                reason = exc if self.exit_points else self.no_exit_heads_reason
                raise InvalidRequestError(f"operating point {op.name!r}: {reason}") from None
        if op.keep_ratio is None or op.keep_ratio >= 1.0:
            return n_vision
        if not getattr(self.backend, "supports_pruning", False):
            raise InvalidRequestError(f"backend {self.backend_name!r} does not support token pruning (keep_ratio)")
        has_cls = int(self.config.exit_geometry.cls_feature)
        if has_cls or vision.token_groups is None:
            return pruned_count(n_vision - has_cls, op.keep_ratio) + has_cls
        return sum(pruned_tokens_per_item(vision, op.keep_ratio))

    def classify(self, image: np.ndarray, *, resolution_px: int | None = None,
                 block: int | None = None) -> dict[str, float]:
        """Closed-set label probabilities of the exit classifier for ``image`` (``(H, W, 3)`` uint8
        RGB), running the vision encoder only up to ``block`` (None = the earliest classifier).

        Returns ``{label: probability}``. Raises InvalidImageError for a bad array and
        InvalidRequestError when the model has no classifier at ``block`` or ``resolution_px`` is not
        an integer in ``1..MAX_RESOLUTION_PX`` (an :class:`OperatingPoint`'s range).
        """
        self._check_image(image)
        if resolution_px is not None and (isinstance(resolution_px, bool) or not isinstance(resolution_px, int)
                                          or not 0 < resolution_px <= MAX_RESOLUTION_PX):
            raise InvalidRequestError(f"resolution_px must be an integer in 1..{MAX_RESOLUTION_PX} (px) or None, "
                                      f"got {resolution_px!r}")
        classify = getattr(self.backend, "classify_image", None)
        if classify is None or not self.labels:
            raise InvalidRequestError("this model has no exit classifier (run `edgevlm calibrate` on it)")
        pixels = preprocess(image, resolution_px or self.image_size_px, self.patch_size_px,
                            self.image_mean, self.image_std)
        with self._lock:
            try:
                probs = classify(torch.from_numpy(pixels)[None], block)  # (1, L)
            except ValueError as exc:
                raise InvalidRequestError(str(exc)) from None
        return dict(zip(self.labels, probs[0].tolist(), strict=True))

    def num_vision_tokens(self, height_px: int, width_px: int) -> int:
        """Vision tokens for an encoder input of ``height_px x width_px`` (LLaVA-style families: the
        config's ``num_vision_tokens``)."""
        return self.config.num_vision_tokens(height_px, width_px)

    @property
    def max_frames(self) -> int:
        """The most frames one request may carry: :data:`MAX_VIDEO_FRAMES` for a video-capable
        family, else the family's ``max_images`` (1: a single image only)."""
        return MAX_VIDEO_FRAMES if self.family.supports_video else max(1, int(self.family.max_images))

    def vision_kinds(self, frames: int) -> list[str]:
        """The vision items this model makes of ``frames`` frames (>= 1), ``"image"`` / ``"video"`` per
        item (``VisionInput.kinds``): one frame is one image; several are one video for a video-capable
        family, else as many images (:meth:`ask`). What :func:`~edgevlm.types.vision_items_error` takes:
        the points a request can run at (the daemon's controller chooses among those)."""
        if frames > 1 and self.family.supports_video:
            return ["video"]
        return ["image"] * max(1, frames)

    def _vision_items(self, image, timestamps_s) -> tuple[list[np.ndarray], list[np.ndarray] | None,
                                                          list[float] | None]:
        """``(images, video frames | None, video timestamps | None)`` for the processor (see :meth:`ask`)."""
        if isinstance(image, np.ndarray):
            if timestamps_s is not None:
                raise InvalidRequestError("frame_timestamps_s is for a list of frames, not one image")
            self._check_image(image)
            return [image], None, None
        if not isinstance(image, list | tuple):
            raise InvalidImageError(f"image must be a numpy array or a list of them, got {type(image).__name__}")
        frames = list(image)
        if not frames:
            raise InvalidRequestError("no frames: give at least one image")
        for f in frames:
            self._check_image(f)
        if len(frames) > self.max_frames:
            what = "a video" if self.family.supports_video else (
                "several images" if self.max_frames > 1 else "one image per request: neither video nor several images")
            raise InvalidRequestError(f"{len(frames)} frames: the {self.family.name} family takes {what}, "
                                      f"at most {self.max_frames} frame(s)",
                                      details={"reason": "too_many_frames", "frames": len(frames),
                                               "max_frames": self.max_frames})  # fmt: skip
        ts = None
        if timestamps_s is not None:
            if not isinstance(timestamps_s, list | tuple) or len(timestamps_s) != len(frames) or not all(
                    isinstance(t, int | float) and not isinstance(t, bool) and np.isfinite(t) for t in timestamps_s):
                raise InvalidRequestError(f"frame_timestamps_s must be {len(frames)} finite numbers (one per frame)")
            ts = [float(t) for t in timestamps_s]
            if any(b <= a for a, b in zip(ts, ts[1:], strict=False)):
                raise InvalidRequestError("frame_timestamps_s must increase")
        if self.vision_kinds(len(frames)) == ["video"]:
            return [], frames, ts
        return frames, None, None

    @staticmethod
    def _check_image(image) -> None:
        if not isinstance(image, np.ndarray):
            raise InvalidImageError(f"image must be a numpy array, got {type(image).__name__}")
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3 or 0 in image.shape:
            raise InvalidImageError(f"image must be an (H, W, 3) uint8 RGB array, got {image.shape} {image.dtype}")

    def _tokens_after(self, token: int, pos: int, max_tokens: int, params, generator, op, rope_delta: int):
        """The tokens after the first one (``token``, fed at slot ``pos``), at most ``max_tokens``:
        greedy requests from the backend's :meth:`~edgevlm.runtime.backends.Backend.greedy_tokens`
        (the torch backend queues each step before the host reads the previous token), sampled ones
        from :func:`~edgevlm.runtime.backends.decode_tokens` with :func:`~edgevlm.runtime.sampling.select_token`."""
        if params.greedy:
            yield from self.backend.greedy_tokens(token, pos, max_tokens, operating_point=op, rope_offset=rope_delta)
            return
        yield from decode_tokens(self.backend, token, pos, max_tokens,
                                 lambda logits: select_token(logits, params, generator), operating_point=op,
                                 rope_offset=rope_delta)

    @staticmethod
    def _check_operating_point(op) -> OperatingPoint:
        if op is None:
            return OperatingPoint()
        if not isinstance(op, OperatingPoint):
            raise InvalidRequestError(f"operating_point must be an OperatingPoint, got {type(op).__name__}")
        return op

    def _generate(self, p: PreparedRequest, t_start: float) -> Generator[str, None, Answer]:
        if self._owner == threading.get_ident():
            raise InvalidRequestError(
                "another stream of this engine is still open in this thread: exhaust or close() it first"
            )
        t_wait = time.perf_counter()
        with self._lock:
            self._owner = threading.get_ident()
            try:
                # a greedy step the last answer queued past its last token (not waited for there): not ours either
                self.backend.synchronize()
                t_start += time.perf_counter() - t_wait  # time waiting for another request is not ours
                return (yield from self._run(p, t_start))
            finally:
                self._owner = None

    def _run(self, p: PreparedRequest, t_start: float) -> Generator[str, None, Answer]:
        be = self.backend
        ids, n_vision, op, params, vision = p.ids, p.n_vision, p.operating_point, p.params, p.vision
        stats = Stats(operating_point=op.name, backend=self.backend_name, vision_tokens=n_vision,
                      prompt_tokens=len(ids) - n_vision, preprocess_ms=p.preprocess_ms)
        if vision.input_sizes_px:
            stats.input_height_px, stats.input_width_px = vision.input_sizes_px[0]
        t1 = time.perf_counter()
        cache = self.vision_cache if p.vision_key is not None else None
        cached = cache.get(p.vision_key) if cache is not None else None
        if p.vision_trunk:  # an early exit over the frame's kept encoder walk (read, then extended)
            trunk = cached[0] if cached is not None else VisionTrunk()
            feats = be.encode_vision(vision, operating_point=op, prompt_ids=torch.tensor([ids], dtype=torch.long),
                                     trunk=trunk)
            info = getattr(be, "last_vision_info", None)
            # from the cache: an earlier question ran this frame's walk (this one at most its deeper blocks, so
            # its vision_ms is no measure of the encoder: the latency controller does not learn from it)
            stats.vision_cached = cached is not None
            cache.put(p.vision_key, trunk)  # re-counted: it may hold more blocks now
        elif cached is not None:  # this frame at this operating point was encoded already
            feats, info = cached
            stats.vision_cached = True
        else:
            if op.exit_threshold is not None:  # question-conditioned exit confidence reads the prompt
                feats = be.encode_vision(vision, operating_point=op,
                                         prompt_ids=torch.tensor([ids], dtype=torch.long))
            else:
                feats = be.encode_vision(vision, operating_point=op)  # vision tokens in the embed's layout
            info = getattr(be, "last_vision_info", None)  # set by backends that ran early exit / pruning
            if cache is not None:
                cache.put(p.vision_key, feats.clone(), info)  # a copy: backends may reuse output buffers
        be.synchronize()
        t2 = time.perf_counter()
        stats.vision_ms = _ms(t1, t2)
        if info is not None:
            stats.exit_layer = info.exit_layers[0]
            stats.exit_confidence = info.exit_confidences[0]
            stats.vision_tokens = info.tokens_kept
        input_ids = torch.tensor([ids], dtype=torch.long, device=be.device)  # (1, T)
        kept = info.kept_index[0] if info is not None and info.kept_index is not None else None
        position_ids, rope_delta = be.position_ids(input_ids, vision, kept_index=kept)  # (None, 0) for 1-D RoPE
        embeds = be.embed(input_ids, feats)  # (1, T, D)
        if position_ids is None:
            logits = be.prefill(embeds, operating_point=op)  # (1, V)
        else:
            logits = be.prefill(embeds, operating_point=op, position_ids=position_ids)
        be.synchronize()
        t3 = time.perf_counter()
        stats.prefill_ms = _ms(t2, t3)

        generator = make_generator(params.seed, logits.device)
        budget = min(params.max_new_tokens, self.max_seq_len - len(ids) + 1)
        decoder = IncrementalDecoder(self.tokenizer)
        text = TextAssembler(params.stop)
        pos, n_new, finish = len(ids), 0, "length"
        t_first = t3
        first = select_token(logits[0], params, generator)
        after = self._tokens_after(first, pos, budget - 1, params, generator, op, rope_delta)
        for token in itertools.chain([first], after):
            n_new += 1
            if n_new == 1:
                t_first = time.perf_counter()
                stats.ttft_ms = _ms(t_start, t_first)
            if token in self.eos_token_ids:
                finish = "stop"
                break
            delta = text.add(decoder.push(token))
            if delta:
                yield delta
            if text.stopped:
                finish = "stop"
                break
            if n_new >= budget:
                break
        after.close()  # a greedy stream's step queued past the last token is left to finish on its own
        tail = text.finish()
        if tail:
            yield tail
        # no device sync: every token was read on the host, and a step queued past an EOS is not waited for
        t_end = time.perf_counter()
        stats.new_tokens = n_new
        stats.decode_ms = _ms(t_first, t_end)
        stats.tpot_ms = stats.decode_ms / (n_new - 1) if n_new > 1 else 0.0
        stats.e2e_ms = _ms(t_start, t_end)
        stats.finish_reason = finish
        logger.debug("answer %r: %s", text.final_text, stats)
        return Answer(text=text.final_text, stats=stats)
