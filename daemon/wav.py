"""WAV (RIFF/WAVE) files: a reader for every common sample format, parsed chunk by chunk.

The stdlib :mod:`wave` module reads integer PCM only; microphones and audio tools also write
IEEE float and ``WAVE_FORMAT_EXTENSIBLE`` files. Format (Microsoft "Multimedia Programming
Interface and Data Specifications 1.0", RIFF/WAVE; "Multiple Channel Audio Data and WAVE Files"
for WAVE_FORMAT_EXTENSIBLE):

- ``RIFF`` <size> ``WAVE``, then chunks: 4-byte id, 4-byte little-endian size, data, a pad byte
  when the size is odd. ``fmt `` and ``data`` are required; others (LIST, fact, ...) are skipped.
- ``fmt ``: wFormatTag (1 = PCM, 3 = IEEE float, 0xFFFE = extensible), nChannels,
  nSamplesPerSec, nAvgBytesPerSec, nBlockAlign, wBitsPerSample; extensible adds cbSize,
  wValidBitsPerSample, dwChannelMask and the SubFormat GUID whose first two bytes are the format
  code (1 or 3) followed by ``00000000-0010-8000-00aa00389b71``.
- PCM samples are little-endian: 8-bit unsigned (offset 128), 16/24/32-bit signed. Valid bits
  below the container size are left-justified, so scaling by the container's full scale is right.

Samples are returned as float32 in [-1, 1) (integers divided by 2^(bits-1)). A file cut short
inside its ``data`` chunk (a recorder killed mid-write) decodes the whole frames that are there,
with one WARNING naming the file and the bytes missing.
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgevlm.errors import InvalidRequestError

logger = logging.getLogger(__name__)

WAVE_FORMAT_PCM = 0x0001
WAVE_FORMAT_IEEE_FLOAT = 0x0003
WAVE_FORMAT_EXTENSIBLE = 0xFFFE
_GUID_TAIL = bytes.fromhex("000000001000800000aa00389b71")


class WavFormatError(InvalidRequestError):
    """Not a WAV file, or a WAV variant this reader does not support (the message says why)."""


@dataclass(frozen=True)
class WavInfo:
    """The ``fmt `` chunk, decoded."""

    format_code: int  # 1 (PCM) or 3 (IEEE float), after resolving WAVE_FORMAT_EXTENSIBLE
    extensible: bool
    channels: int
    sample_rate_hz: int
    bits_per_sample: int
    block_align: int
    valid_bits: int
    channel_mask: int = 0


def _parse_fmt(body: bytes, where: str) -> WavInfo:
    if len(body) < 16:
        raise WavFormatError(f"{where}: fmt chunk of {len(body)} bytes is too short (16 needed)")
    tag, channels, rate, _, block_align, bits = struct.unpack_from("<HHIIHH", body, 0)
    extensible = tag == WAVE_FORMAT_EXTENSIBLE
    valid, mask = bits, 0
    if extensible:
        if len(body) < 40:
            raise WavFormatError(f"{where}: WAVE_FORMAT_EXTENSIBLE fmt chunk of {len(body)} bytes (40 needed)")
        valid, mask = struct.unpack_from("<HI", body, 18)
        guid = body[24:40]
        if guid[2:] != _GUID_TAIL:
            raise WavFormatError(f"{where}: unsupported WAVE_FORMAT_EXTENSIBLE sub-format {guid.hex()}")
        tag = struct.unpack_from("<H", guid, 0)[0]
    if tag not in (WAVE_FORMAT_PCM, WAVE_FORMAT_IEEE_FLOAT):
        raise WavFormatError(f"{where}: unsupported format code 0x{tag:04x} (PCM and IEEE float are supported)")
    if channels < 1 or rate < 1:
        raise WavFormatError(f"{where}: {channels} channels at {rate} Hz")
    ok_bits = (8, 16, 24, 32) if tag == WAVE_FORMAT_PCM else (32, 64)
    if bits not in ok_bits:
        kind = "PCM" if tag == WAVE_FORMAT_PCM else "float"
        raise WavFormatError(f"{where}: {bits}-bit {kind} samples are not supported (use {ok_bits})")
    if block_align != channels * bits // 8:
        raise WavFormatError(f"{where}: block align {block_align} != channels x bytes per sample")
    return WavInfo(tag, extensible, channels, rate, bits, block_align, valid or bits, mask)


def decode_samples(data: bytes, info: WavInfo) -> np.ndarray:
    """Raw ``data`` chunk bytes -> ``(frames, channels)`` float32 in [-1, 1)."""
    n = len(data) // info.block_align
    data = data[: n * info.block_align]
    bits = info.bits_per_sample
    if info.format_code == WAVE_FORMAT_IEEE_FLOAT:
        x = np.frombuffer(data, "<f4" if bits == 32 else "<f8").astype(np.float32)
    elif bits == 8:
        x = (np.frombuffer(data, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif bits == 16:
        x = np.frombuffer(data, "<i2").astype(np.float32) / 32768.0
    elif bits == 24:
        b = np.frombuffer(data, np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        v = np.where(v >= 1 << 23, v - (1 << 24), v)  # sign-extend
        x = v.astype(np.float32) / float(1 << 23)
    else:
        x = (np.frombuffer(data, "<i4").astype(np.float64) / float(1 << 31)).astype(np.float32)
    return x.reshape(n, info.channels)


def read_wav_info(path: str | Path) -> tuple[WavInfo, int]:
    """The format and the number of whole sample frames of a WAV file, reading only its chunk headers (the
    start-up checks: ``edgevlm serve --check-config``).

    Raises:
        WavFormatError: as :func:`read_wav` (not RIFF/WAVE, no ``fmt ``/``data`` chunk, an unsupported format).
        OSError: the file cannot be read.
    """
    where = str(path)
    with open(path, "rb") as f:
        size_all = os.fstat(f.fileno()).st_size
        head = f.read(12)
        if head[:4] == b"RF64":
            raise WavFormatError(f"{where}: RF64 (WAV over 4 GiB) is not supported")
        if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
            raise WavFormatError(f"{where}: not a RIFF/WAVE file")
        info, data_bytes = None, None
        while info is None or data_bytes is None:
            header = f.read(8)
            if len(header) < 8:
                break
            cid, size = header[:4], struct.unpack("<I", header[4:])[0]
            start = f.tell()
            if cid == b"fmt ":
                info = _parse_fmt(f.read(size), where)
            elif cid == b"data":
                data_bytes = min(size, size_all - start)  # a data chunk cut short keeps its whole frames
            f.seek(start + size + (size & 1))
    if info is None:
        raise WavFormatError(f"{where}: no fmt chunk")
    if data_bytes is None:
        raise WavFormatError(f"{where}: no data chunk")
    return info, data_bytes // info.block_align


def read_wav(path: str | Path) -> tuple[np.ndarray, WavInfo]:
    """Read a WAV file.

    Returns:
        ``(samples, info)``: samples ``(frames, channels)`` float32 in [-1, 1).

    Raises:
        WavFormatError: not RIFF/WAVE, a missing ``fmt ``/``data`` chunk, a truncated chunk
            header, or an unsupported format (the message names the file and the reason).
        OSError: the file cannot be read.

    A ``data`` chunk cut short is decoded as far as it goes (one WARNING names the file and the
    missing bytes).
    """
    where = str(path)
    raw = Path(path).read_bytes()
    if raw[:4] == b"RF64":
        raise WavFormatError(f"{where}: RF64 (WAV over 4 GiB) is not supported")
    if len(raw) < 12 or raw[:4] != b"RIFF" or raw[8:12] != b"WAVE":
        raise WavFormatError(f"{where}: not a RIFF/WAVE file")
    pos, info, data = 12, None, None
    while pos + 8 <= len(raw):
        cid, size = raw[pos : pos + 4], struct.unpack_from("<I", raw, pos + 4)[0]
        body = raw[pos + 8 : pos + 8 + size]
        if cid == b"fmt ":
            info = _parse_fmt(body, where)
        elif cid == b"data":
            data = body  # a data chunk cut short by a truncated file keeps its whole frames
            if len(body) < size:
                logger.warning("%s: truncated WAV file: the data chunk declares %d bytes, %d are missing; "
                               "decoding the %d bytes there", where, size, size - len(body), len(body))
            if info is not None:
                break
        pos += 8 + size + (size & 1)
    if info is None:
        raise WavFormatError(f"{where}: no fmt chunk")
    if data is None:
        raise WavFormatError(f"{where}: no data chunk")
    return decode_samples(data, info), info
