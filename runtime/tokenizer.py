"""Tokenizer and chat template of a VLM checkpoint, over the ``tokenizers`` library.

Files (Hugging Face conventions): ``tokenizer.json`` (required); the chat template from
``chat_template.jinja``, ``chat_template.json`` (``{"chat_template": ...}``) or
``tokenizer_config.json``'s ``chat_template`` (string, or a list of ``{name, template}``); the
``bos_token``/``eos_token`` strings from ``tokenizer_config.json``. The template is rendered like
transformers' ``apply_chat_template`` (jinja2 ``ImmutableSandboxedEnvironment``, ``trim_blocks``,
``lstrip_blocks``, ``raise_exception``) with one user turn holding one image (or video) content part
per item and the prompt, under the step, time and size limits of :mod:`edgevlm.runtime.chat_template`;
transformers' ``{% generation %}...{% endgeneration %}`` tag (which marks assistant text for training
masks, as in the llava-hf templates) renders its body. The family's processor then expands each
placeholder to its vision tokens (``Processor.expand_prompt``).
Without a template the LLaVA-1.5 prompt ``"USER: <image>\\n{prompt} ASSISTANT:"`` is used for the llava
family only; a checkpoint of another family without one is refused (that prompt is not its format).

Streaming uses the prefix/read-offset incremental detokenisation of text-generation-inference:
text is emitted only once it no longer ends in an incomplete UTF-8 sequence (U+FFFD).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from edgevlm.errors import InvalidRequestError, ModelLoadError

if TYPE_CHECKING:
    from edgevlm.runtime.models.base import Processor, VisionInput

logger = logging.getLogger(__name__)


def _generation_extension():
    """A jinja2 extension for transformers' ``{% generation %}`` block tag: renders its body
    unchanged (transformers uses it only to find the assistant's tokens for training masks)."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return GenerationTag

FALLBACK_TEMPLATE = "USER: {image}{prompt} ASSISTANT:"
_PROBE = "edgevlm-probe-prompt"


def _token_str(value) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_chat_template(model_dir: Path, tok_cfg: dict) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    as_json = model_dir / "chat_template.json"
    if as_json.is_file():
        try:
            value = json.loads(as_json.read_text(encoding="utf-8")).get("chat_template")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise ModelLoadError(f"{as_json}: not a JSON object with 'chat_template' ({exc})") from exc
        if isinstance(value, str):
            return value
    value = tok_cfg.get("chat_template")
    if isinstance(value, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default") or next(iter(named.values()), None)
    return value if isinstance(value, str) else None


class VLMTokenizer:
    """Prompt rendering, image-token expansion and decoding for one checkpoint.

    Raises ModelLoadError (from :meth:`from_dir`) when ``tokenizer.json`` is missing or invalid,
    the image token id has no token, or the chat template cannot render a user turn.
    """

    def __init__(self, tokenizer, image_token_id: int, chat_template: str | None,
                 bos_token: str | None, eos_token: str | None) -> None:
        self.tok = tokenizer
        self.image_token_id = image_token_id
        self.image_token = tokenizer.id_to_token(image_token_id)
        if self.image_token is None:
            raise ModelLoadError(f"tokenizer.json has no token with the image token id {image_token_id}")
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self._template = None
        self._string_content = False
        self._insert_image = False
        if chat_template is not None:
            self._compile(chat_template)
        probe_ids = self.tok.encode(self.render_prompt(_PROBE), add_special_tokens=False).ids
        if probe_ids.count(image_token_id) != 1:
            raise ModelLoadError(
                f"the rendered prompt does not encode the image token {self.image_token!r} as exactly one "
                f"token (is it an added special token in tokenizer.json?)"
            )

    @classmethod
    def from_dir(cls, model_dir: str | Path, image_token_id: int, *, family: str = "llava") -> VLMTokenizer:
        """The tokenizer and chat template of the checkpoint folder ``model_dir``; ``family`` is its
        registry name (``ModelFamily.name``): only ``"llava"`` may fall back to the LLaVA-1.5 prompt.

        Raises:
            ModelLoadError: see the class; also no chat template in a folder of another family than llava.
        """
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"model folder {model_dir} has no tokenizer.json")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on parse errors
            raise ModelLoadError(f"{path}: cannot load tokenizer ({exc})") from exc
        tok_cfg: dict = {}
        cfg_path = model_dir / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                tok_cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise ModelLoadError(f"{cfg_path}: not valid JSON ({exc})") from exc
        template = _read_chat_template(model_dir, tok_cfg)
        if template is None and family != "llava":
            raise ModelLoadError(
                f"model folder {model_dir} has no chat template (chat_template.jinja, chat_template.json or "
                f"tokenizer_config.json's chat_template): the {family} family needs its checkpoint's own (the "
                "built-in fallback is LLaVA-1.5's prompt); copy it from the original checkpoint"
            )
        return cls(tok, image_token_id, template,
                   _token_str(tok_cfg.get("bos_token")), _token_str(tok_cfg.get("eos_token")))

    # ---- chat template -------------------------------------------------------------------------
    def _compile(self, source: str) -> None:
        from edgevlm.runtime.chat_template import (
            ChatTemplateBudgetError,
            ChatTemplateError,
            compile_chat_template,
        )

        try:  # sandboxed and bounded: see edgevlm.runtime.chat_template
            self._template = compile_chat_template(source, extensions=[_generation_extension()])
        except ChatTemplateError as exc:
            raise ModelLoadError(exc.message) from exc
        # Probe: structured content (transformers' multimodal format) first, then a plain string.
        for string_content in (False, True):
            self._string_content = string_content
            try:
                out = self._render(_PROBE, insert_image=string_content)
            except ChatTemplateBudgetError as exc:
                raise ModelLoadError(f"{exc.message} (rendering a plain user turn)") from exc
            except Exception as exc:  # a template may fail on a content type it does not expect
                logger.debug("chat template probe (string_content=%s) failed: %s", string_content, exc)
                continue
            if _PROBE in out and "'type'" not in out:
                self._insert_image = string_content or self.image_token not in out
                return
        raise ModelLoadError("chat template cannot render a user turn with an image and a text prompt")

    def _render(self, prompt: str, insert_image: bool, kinds: tuple[str, ...] | list[str] = ("image",)) -> str:
        if insert_image and any(k != "image" for k in kinds):
            raise InvalidRequestError("this checkpoint's chat template has no video content part")
        text = f"{self.image_token}\n" * len(kinds) + prompt if insert_image else prompt
        if self._string_content:
            content: object = text
        else:
            content = ([] if insert_image else [{"type": k} for k in kinds]) + [{"type": "text", "text": text}]
        return self._template.render(
            messages=[{"role": "user", "content": content}], add_generation_prompt=True,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )

    def render_prompt(self, prompt: str, kinds: tuple[str, ...] | list[str] = ("image",)) -> str:
        """The full prompt text for one user turn holding one placeholder per item of ``kinds``
        (``"image"`` / ``"video"`` content parts, in order) and then ``prompt``."""
        if self._template is None:
            if any(k != "image" for k in kinds):
                raise InvalidRequestError("the fallback prompt (no chat template) has no video placeholder")
            return FALLBACK_TEMPLATE.format(image=f"{self.image_token}\n" * len(kinds), prompt=prompt)
        return self._render(prompt, insert_image=self._insert_image, kinds=kinds)

    # ---- encode / decode -----------------------------------------------------------------------
    def _encode_text(self, text: str) -> list[int]:
        """BOS is added by the tokenizer's post-processor unless ``text`` already starts with it."""
        add_special = not (self.bos_token and text.startswith(self.bos_token))
        return self.tok.encode(text, add_special_tokens=add_special).ids

    def encode_request(self, prompt: str, vision: VisionInput, processor: Processor) -> list[int]:
        """Token ids of the prompt for the items of ``vision``: the chat template rendered with one
        content part per item, each placeholder expanded by ``processor.expand_prompt``
        (the family's token runs), then tokenised.

        Raises:
            InvalidRequestError: the prompt itself contains the image token, or the expanded prompt
                does not hold exactly the vision tokens of ``vision``'s images.
        """
        text = processor.expand_prompt(self.render_prompt(prompt, vision.kinds), vision)
        ids = self._encode_text(text)
        if all(k == "image" for k in vision.kinds):
            found = sum(1 for t in ids if t == self.image_token_id)
            if found != vision.num_tokens:
                raise InvalidRequestError(
                    f"the prompt must not contain the image token {self.image_token!r} "
                    f"({found} image tokens for {vision.num_tokens} vision tokens)")
        return ids

    def encode_prompt(self, prompt: str, n_vision_tokens: int) -> list[int]:
        """Token ids of the rendered prompt for one image with its image token expanded to
        ``n_vision_tokens`` copies (LLaVA's expansion; calibration and quantization use it).

        Raises:
            InvalidRequestError: the prompt itself contains the image token.
        """
        ids = self._encode_text(self.render_prompt(prompt))
        slots = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(slots) != 1:
            raise InvalidRequestError(
                f"the prompt must not contain the image token {self.image_token!r} "
                f"(found {len(slots) - 1} in the prompt)"
            )
        p = slots[0]
        return ids[:p] + [self.image_token_id] * n_vision_tokens + ids[p + 1:]

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` without special tokens."""
        return self.tok.decode(ids, skip_special_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tok.token_to_id(token)


class IncrementalDecoder:
    """Turns generated token ids into text deltas without splitting multi-byte characters or
    losing the spaces a tokenizer only renders between tokens (prefix/read offsets, as in
    text-generation-inference's ``decode_token``)."""

    def __init__(self, tokenizer: VLMTokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        """Add one token; returns the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix):]
        return ""
