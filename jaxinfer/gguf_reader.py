"""gguf-py's memory-mapped `GGUFReader`, bounded so that no corrupt file can crash it, hang it or exhaust memory.

gguf-py trusts the file: a read past the end returns an empty array, so an array whose count is 2^31 (or a value
type of ARRAY where a string belongs) loops for ever, building two numpy arrays per element; a tensor offset past
2^64 wraps around; duplicate tensors, bad type ids and non-UTF-8 names surface as assorted exceptions. Here every
read is checked against the file's size, every count and length against the bytes that remain before anything is
allocated, and every tensor's type, size, alignment and extent before its view is made. Each problem is a
`CorruptGGUF` naming the key or tensor and what was expected vs found.

Metadata arrays are read whole: gguf-py builds two numpy views per string and one per number, 0.75 s for the default
model's 49k-token vocabulary, 49k merges and token types. Here an array is one `ArrayField` whose parts are the
array's header and its items' bytes in one view; string lengths are checked as the field is read, and the strings are
decoded only when `contents()` asks for them.

Overrides private methods of GGUFReader: gguf is pinned to a minor release (0.19.x).
"""

import math
import struct
import sys

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField, ReaderTensor

from jaxinfer.ternary import I2_S, QUANT_SIZES, i2_s_nbytes, quant_type, unsupported_type_note

GGUF_MAGIC = b"GGUF"
POWERINFER_MAGIC = b"PWRI"  # PowerInfer: a GGUF v3 file whose first 4 bytes say it carries sparse-inference tensors
GGML_MAX_DIMS = 4
STRING_LENGTH_BYTES = 8
# The fewest bytes one item can occupy, so a count can be checked against the bytes left before any item is read.
MIN_VALUE_BYTES = {vtype: np.dtype(np_type).itemsize for vtype, np_type in GGUFReader.gguf_scalar_to_np.items()}
MIN_VALUE_BYTES[GGUFValueType.STRING] = STRING_LENGTH_BYTES
MIN_KEY_VALUE_BYTES = STRING_LENGTH_BYTES + 4 + 1  # key length, value type, the smallest value
MIN_TENSOR_INFO_BYTES = STRING_LENGTH_BYTES + 4 + 8 + 4 + 8  # name length, n_dims, one dimension, type, offset


class CorruptGGUF(ValueError):
    """The file's bytes contradict the GGUF format (the message says where and how)."""


def shown(name: str, limit: int = 80) -> str:
    """A name read from a file as a one-line message can show it: control characters escaped, long names cut."""
    text = name if name.isprintable() else repr(name)[1:-1]
    return text if len(text) <= limit else text[:limit] + "..."


def _decode(data: np.ndarray, what: str) -> str:
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptGGUF(f"{what} is not UTF-8 ({e.reason} at byte {e.start})") from None


class ArrayField(ReaderField):
    """A metadata array as gguf-py's ReaderField has it, except that its items are one part: `parts` are the key's
    length and bytes, the value type, the item type, the count and the items (the numbers as one array, or the
    strings as the bytes of their lengths and UTF-8 texts), so that the parts' sizes still add up to the field's."""

    def contents(self, index_or_slice: int | slice = slice(None)):
        items = self.parts[5]
        if self.types[-1] != GGUFValueType.STRING:
            return items[index_or_slice].tolist()
        raw = items.tobytes()
        length = struct.Struct(self.parts[4].dtype.byteorder + "Q")  # the count's byte order is the file's
        texts, offset = [], 0
        for _ in range(array_length(self)):
            (n,) = length.unpack_from(raw, offset)
            texts.append(raw[offset + STRING_LENGTH_BYTES:offset + STRING_LENGTH_BYTES + n])
            offset += STRING_LENGTH_BYTES + n
        chosen = texts[index_or_slice]
        # UnicodeDecodeError as gguf-py raises it: the caller names the key
        return chosen.decode("utf-8") if isinstance(chosen, bytes) else [text.decode("utf-8") for text in chosen]


def array_length(field: ReaderField) -> int:
    """The item count of a metadata array field (gguf-py's or an ArrayField)."""
    return int(field.parts[4][0])


class Reader(GGUFReader):
    """GGUFReader that is bounded (see the module docstring), reads PowerInfer files, and slices plain ndarray views.

    PowerInfer writes `PWRI` where GGUF has its magic and leaves the rest of the file GGUF v3, so the magic read at
    offset 0 answers GGUF for it. Slices of the file come from a plain view: an np.memmap slice carries its own
    attribute dict (~90 MiB when gguf-py sliced each string of a 49k-token vocabulary with 49k merges)."""

    def _get(self, offset, dtype, count=1, override_order=None):
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        offset, count = int(offset), int(count)
        if offset == 0 and plain[:4].tobytes() == POWERINFER_MAGIC:
            return np.frombuffer(GGUF_MAGIC, dtype=np.uint32)
        itemsize = np.dtype(dtype).itemsize
        end = offset + itemsize * count
        if offset < 0 or count < 0 or end > len(plain):
            raise CorruptGGUF(f"{count} x {itemsize} bytes at offset {offset} run past the end of the file "
                              f"({len(plain)} bytes)")
        arr = plain[offset:end].view(dtype=dtype)
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _check_count(self, count, least_bytes: int, offset: int, what: str) -> None:
        remaining = len(self._plain) - offset
        if int(count) * least_bytes > remaining:
            raise CorruptGGUF(f"{int(count)} {what} at offset {offset} need at least {int(count) * least_bytes} "
                              f"bytes, only {remaining} remain in the file")

    @staticmethod
    def _value_type(raw, offset: int) -> GGUFValueType:
        try:
            return GGUFValueType(int(raw))
        except ValueError:
            raise CorruptGGUF(f"unknown value type id {int(raw)} at offset {offset}") from None

    def _get_field_parts(self, orig_offs, raw_type):
        if self._value_type(raw_type, orig_offs) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_item_type = self._get(orig_offs, np.uint32)
        item_type = self._value_type(raw_item_type[0], orig_offs)
        if item_type == GGUFValueType.ARRAY:
            raise CorruptGGUF(f"array of arrays at offset {orig_offs} (GGUF readers do not support nesting)")
        count = self._get(orig_offs + 4, np.uint64)
        start = orig_offs + 12
        self._check_count(count[0], MIN_VALUE_BYTES[item_type], start, f"{item_type.name} array items")
        if item_type == GGUFValueType.STRING:
            items = self._get(start, np.uint8, self._strings_size(start, int(count[0])))
        else:
            items = self._get(start, self.gguf_scalar_to_np[item_type], count[0])
        types = [GGUFValueType.ARRAY] + ([item_type] if count[0] else [])  # gguf-py's: no item type when empty
        return 12 + int(items.nbytes), [raw_item_type, count, items], [2], types

    def _strings_size(self, offset: int, count: int) -> int:
        """Bytes of the `count` length-prefixed strings at `offset`, each checked to end within the file."""
        plain = memoryview(self._plain)
        order = "<" if (sys.byteorder == "little") == (self.byte_order == "I") else ">"
        length = struct.Struct(order + "Q")
        end = offset
        for _ in range(count):
            if end + STRING_LENGTH_BYTES > len(plain):
                self._get(end, np.uint64)  # raises CorruptGGUF naming the read
            (n,) = length.unpack_from(plain, end)
            if end + STRING_LENGTH_BYTES + n > len(plain):
                self._get(end + STRING_LENGTH_BYTES, np.uint8, n)
            end += STRING_LENGTH_BYTES + n
        return end - offset

    def _build_fields(self, offs, count):
        self._check_count(count, MIN_KEY_VALUE_BYTES, offs, "metadata key/value pairs")
        for _ in range(int(count)):
            orig_offs = offs
            key_length, key_data = self._get_str(offs)
            key = _decode(key_data, f"the metadata key at offset {orig_offs}")
            offs += int(key_length.nbytes + key_data.nbytes)
            raw_type = self._get(offs, np.uint32)
            offs += int(raw_type.nbytes)
            try:
                size, parts, indices, types = self._get_field_parts(offs, raw_type[0])
            except CorruptGGUF as e:
                raise CorruptGGUF(f"metadata {shown(key)}: {e}") from None
            if key in self.fields:
                raise CorruptGGUF(f"metadata key {shown(key)} appears twice (offsets {self.fields[key].offset} and "
                                  f"{orig_offs})")
            head = [key_length, key_data, raw_type]
            field_type = ArrayField if types[0] == GGUFValueType.ARRAY else ReaderField
            self.fields[key] = field_type(orig_offs, key, head + parts, [i + len(head) for i in indices], types)
            offs += size
        return offs

    def _build_tensor_info(self, offs, count):
        self._check_count(count, MIN_TENSOR_INFO_BYTES, offs, "tensor infos")
        fields, names = [], set()
        for _ in range(int(count)):
            _, name_data = self._get_str(offs)
            name = _decode(name_data, f"the tensor name at offset {offs}")
            n_dims = int(self._get(offs + STRING_LENGTH_BYTES + len(name_data), np.uint32)[0])
            if not 1 <= n_dims <= GGML_MAX_DIMS:
                raise CorruptGGUF(f"tensor {shown(name)} has {n_dims} dimensions, expected 1 to {GGML_MAX_DIMS}")
            if name in names:
                raise CorruptGGUF(f"tensor {shown(name)} appears twice")
            names.add(name)
            field = self._get_tensor_info_field(offs)
            offs += sum(int(part.nbytes) for part in field.parts)
            fields.append(field)
        return offs, fields

    def _build_tensors(self, start_offs, fields):
        """Check every tensor's type, size, alignment and extent (in Python integers: nothing wraps) before gguf-py
        makes its views; I2_S tensors, which gguf-py cannot size, are viewed here, tail included."""
        size, alignment = len(self._plain), int(self.alignment)
        extents, names, i2_s = [], [], {}
        for field in fields:
            _, name_data, _, dims, raw_type, relative_offset = field.parts
            name = bytes(name_data).decode("utf-8")
            names.append(name)
            try:
                qtype = quant_type(int(raw_type[0]))
            except ValueError:
                type_id = int(raw_type[0])
                raise CorruptGGUF(f"tensor {shown(name)} has unknown type id {type_id}"
                                  f"{unsupported_type_note(type_id)}") from None
            dims = [int(n) for n in dims]
            if min(dims) < 1:
                raise CorruptGGUF(f"tensor {shown(name)} has an empty dimension (shape {dims})")
            block_size, type_size = QUANT_SIZES[qtype]
            if dims[0] % block_size:
                raise CorruptGGUF(f"tensor {shown(name)}: rows of {dims[0]} values are not whole {qtype.name} "
                                  f"blocks of {block_size}")
            relative = int(relative_offset[0])
            if relative % alignment:
                raise CorruptGGUF(f"tensor {shown(name)}'s data offset {relative} is not a multiple of the alignment "
                                  f"{alignment}")
            start = start_offs + relative
            n_values = math.prod(dims)
            end = start + (i2_s_nbytes(n_values) if qtype == I2_S else n_values // block_size * type_size)
            if end > size:
                raise CorruptGGUF(f"tensor {shown(name)} ({qtype.name} {dims}) spans bytes {start} to {end}, past the "
                                  f"end of the file ({size} bytes)")
            extents.append((start, end, name))
            if qtype == I2_S:
                i2_s[name] = ReaderTensor(name, qtype, dims, n_values, end - start, start, self._get(start, np.uint8,
                                                                                                  end - start), field)
        extents.sort()
        for (_, end, name), (start, _, next_name) in zip(extents, extents[1:]):
            if start < end:
                raise CorruptGGUF(f"tensors {shown(name)} and {shown(next_name)} overlap in the file")
        super()._build_tensors(start_offs, [field for field, name in zip(fields, names) if name not in i2_s])
        built = {t.name: t for t in self.tensors} | i2_s
        self.tensors = [built[name] for name in names]


class TolerantReader(Reader):
    """Reader for inspecting a file rather than running it: a tensor whose type, size, alignment or extent is wrong
    is left out of `tensors` (its name in `unreadable`) instead of failing the whole file, so that one bad tensor does
    not hide the others; `tensor_problems` holds every such problem's message (and an overlap's), `tensor_infos`
    every tensor as its info reads: (name, type id, GGML dims, data offset)."""

    def _build_tensors(self, start_offs, fields):
        self.tensor_problems, self.tensor_infos, self.unreadable, readable = [], [], set(), []
        for field in fields:
            _, name_data, _, dims, raw_type, relative_offset = field.parts
            name = bytes(name_data).decode("utf-8")
            self.tensor_infos.append((name, int(raw_type[0]), [int(n) for n in dims],
                                      int(start_offs) + int(relative_offset[0])))  # Python ints: nothing wraps
            try:
                super()._build_tensors(start_offs, [field])  # this tensor's own checks, as a run makes them
            except ValueError as e:  # CorruptGGUF, or gguf-py's own
                self.tensor_problems.append(str(e))
                self.unreadable.add(name)
            else:
                readable.append(field)
        try:
            super()._build_tensors(start_offs, readable)  # what only the tensors together show: overlaps
        except ValueError as e:
            self.tensor_problems.append(str(e))
            GGUFReader._build_tensors(self, start_offs, readable)  # views of them all, overlapping or not
