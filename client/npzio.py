""".npz files read and written in bounded memory, for inputs and outputs larger than RAM.

Reading: `np.savez` stores each array as an uncompressed zip member, and the .npy inside a
stored member is one contiguous run of bytes, so `open_npz` memory-maps it at the member's data
offset (the local file header's length says where the data starts). Compressed members
(`np.savez_compressed`) cannot be mapped; they are loaded whole, so such a shard must fit in RAM.

Writing: `write_npz` streams each member from an iterable of chunks, writing the .npy header
by hand for the final shape first; the zip is ZIP64 so members may exceed 4 GiB. The file
appears whole or not at all (`attnserve.files.write_atomic`).
"""

from __future__ import annotations

import math
import struct
import time
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from numpy.lib import format as npy_format

from attnserve.files import write_atomic

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, 22 bytes we skip, name length, extra length
_LOCAL_SIGNATURE = b"PK\x03\x04"


@dataclass(frozen=True)
class MemberInfo:
    """What an .npz member holds, read from its .npy header without reading its data."""

    shape: tuple[int, ...]
    dtype: np.dtype
    stored: bool  # uncompressed, so it can be memory-mapped


def _read_npy_header(f) -> tuple[tuple[int, ...], bool, np.dtype]:
    version = npy_format.read_magic(f)
    if version == (1, 0):
        return npy_format.read_array_header_1_0(f)
    if version == (2, 0):
        return npy_format.read_array_header_2_0(f)
    raise ValueError(f"unsupported .npy format version {version}")


def _member_name(info: zipfile.ZipInfo) -> str | None:
    return info.filename[:-4] if info.filename.endswith(".npy") and not info.is_dir() else None


def read_headers(path: str | Path) -> dict[str, MemberInfo]:
    """Each array's shape and dtype, without reading the arrays."""
    headers = {}
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            name = _member_name(info)
            if name is None:
                continue
            with zf.open(info) as member:
                shape, _, dtype = _read_npy_header(member)
            headers[name] = MemberInfo(tuple(shape), dtype, info.compress_type == zipfile.ZIP_STORED)
    return headers


def _memmap_member(path: Path, f, info: zipfile.ZipInfo) -> np.ndarray | None:
    """The member's array memory-mapped read-only, or None when it cannot be mapped."""
    if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:  # compressed or encrypted
        return None
    f.seek(info.header_offset)
    signature, name_length, extra_length = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
    if signature != _LOCAL_SIGNATURE:
        return None
    start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
    f.seek(start)
    try:
        shape, fortran_order, dtype = _read_npy_header(f)
    except ValueError:
        return None
    data_offset = f.tell()
    nbytes = math.prod(shape) * dtype.itemsize
    if dtype.hasobject or data_offset - start + nbytes != info.file_size:
        return None  # not a plain .npy of fixed-size elements: let numpy read it
    if nbytes == 0:
        return np.empty(shape, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=data_offset, shape=tuple(shape),
                     order="F" if fortran_order else "C")


def open_npz(path: str | Path) -> dict[str, np.ndarray]:
    """Every array of an .npz: memory-mapped when stored uncompressed, else loaded into memory."""
    path = Path(path)
    arrays: dict[str, np.ndarray] = {}
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        for info in zf.infolist():
            name = _member_name(info)
            if name is None:
                continue
            array = _memmap_member(path, f, info)
            if array is None:
                with zf.open(info) as member:
                    array = npy_format.read_array(member, allow_pickle=False)
            arrays[name] = array
    return arrays


def read_comment(path: str | Path) -> bytes:
    """The zip archive comment of an .npz (b'' when there is none or it is not a zip)."""
    try:
        with zipfile.ZipFile(path) as zf:
            return zf.comment
    except (OSError, zipfile.BadZipFile):
        return b""


@dataclass(frozen=True)
class StreamedMember:
    """One array to write: its final dtype and shape, and its rows as chunks in order."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    chunks: Iterable[np.ndarray]


def _write_member(zf: zipfile.ZipFile, member: StreamedMember) -> None:
    dtype = np.dtype(member.dtype)
    header = {"descr": npy_format.dtype_to_descr(dtype), "fortran_order": False, "shape": tuple(member.shape)}
    info = zipfile.ZipInfo(member.name + ".npy", date_time=time.localtime()[:6])
    info.compress_type = zipfile.ZIP_STORED
    expected = math.prod(member.shape) * dtype.itemsize
    written = 0
    with zf.open(info, mode="w", force_zip64=True) as out:
        try:
            npy_format.write_array_header_1_0(out, header)
        except ValueError:  # header over 64 KiB
            npy_format.write_array_header_2_0(out, header)
        for chunk in member.chunks:
            chunk = np.ascontiguousarray(chunk, dtype=dtype)
            if chunk.shape[1:] != tuple(member.shape[1:]):
                raise ValueError(f"{member.name}: chunk of shape {chunk.shape} does not fit rows of {member.shape[1:]}")
            out.write(memoryview(chunk).cast("B"))
            written += chunk.nbytes
    if written != expected:
        raise ValueError(f"{member.name}: wrote {written} bytes of data for shape {member.shape}, expected {expected}")


def write_npz(path: str | Path, members: Sequence[StreamedMember], comment: bytes = b"") -> None:
    """Write an .npz (stored, ZIP64) from streamed members, atomically (`attnserve.files`)."""

    def write(f: BinaryIO) -> None:
        with zipfile.ZipFile(f, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for member in members:
                _write_member(zf, member)
            zf.comment = comment

    write_atomic(Path(path), write)
