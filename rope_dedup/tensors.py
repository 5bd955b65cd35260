"""Where a tensor's memory lives, and every tensor a module holds: the lowest layer, imported by all.

Plain tensors are taken as they are, a DTensor as its local shard.

A replicated DTensor is a wrapper with no storage of its own (its ``data_ptr()`` is 0); each rank's
memory is its local tensor. Sharing, pointer checks and byte counts all go through these helpers,
and this is the only module that reaches into DTensor's private ``_local_tensor``.
"""

from __future__ import annotations

import enum
from typing import Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed support
    DTensor = None  # type: ignore[assignment, misc]


def is_dtensor(tensor: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(tensor, DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that owns the memory: the local shard of a DTensor, else the tensor itself."""
    return tensor._local_tensor if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def placement(tensor: torch.Tensor) -> tuple | None:
    """(mesh, placements) of a DTensor, None for a plain tensor: tables share only within one."""
    return (tensor.device_mesh, tuple(tensor.placements)) if is_dtensor(tensor) else None  # type: ignore[attr-defined]


def describe_placement(where: tuple | None) -> str | None:
    if where is None:
        return None
    mesh, placements = where
    return f"{', '.join(map(repr, placements))} on mesh {tuple(mesh.shape)} {mesh.device_type}"


def memory_ptr(tensor: torch.Tensor) -> int:
    """Address of the first element this tensor reads (the local one for a DTensor)."""
    return local(tensor).data_ptr()


def storage_ptr(tensor: torch.Tensor) -> int:
    return local(tensor).untyped_storage().data_ptr()


def storage_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the storage behind a tensor (what freeing it would return), not its view's size."""
    return local(tensor).untyped_storage().nbytes()


def is_plain(tensor: torch.Tensor) -> bool:
    """A tensor or parameter, not a subclass: the only kind whose data rope_dedup reads, compares or aliases
    (a subclass may hold no data of its own, or several tensors)."""
    return type(tensor) in (torch.Tensor, torch.nn.Parameter)


def has_storage(tensor: torch.Tensor) -> bool:
    """Whether the tensor's memory can be compared by address (not meta, not a storage-less wrapper)."""
    inner = local(tensor)
    return is_plain(inner) and not inner.is_meta


def readable(tensor: torch.Tensor) -> bool:
    """Whether the tensor's storage still holds every element it addresses: not freed or shrunk in place
    (``untyped_storage().resize_(0)``, as offloading and sleep modes do), not meta. Any read of a tensor
    whose storage shrank, ``torch.equal`` included, is a segmentation fault, not an exception."""
    inner = local(tensor)
    if not is_plain(inner) or inner.is_meta:
        return False
    if inner.numel() == 0:
        return True
    extent = 1 + sum((size - 1) * stride for size, stride in zip(inner.shape, inner.stride()))
    return inner.untyped_storage().nbytes() >= (inner.storage_offset() + extent) * inner.element_size()


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: only tables of the very same bits share. ``torch.equal`` counts -0.0 equal to +0.0
    (and NaN unequal to itself), so floating and complex values are compared as integers of their width."""
    return torch.equal(bits(a), bits(b))


# Integer dtypes as wide as each floating element: a view of a table's bits, no copy.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of its element's width (complex: real and imaginary parts), a view."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    return tensor.view(_BITS[tensor.element_size()]) if tensor.is_floating_point() else tensor


def memory_key(tensor: torch.Tensor) -> tuple[torch.device, int]:
    """Where the first element this tensor reads lives: device and address (addresses of two devices may
    coincide, and every meta tensor's is 0)."""
    inner = local(tensor)
    return inner.device, inner.data_ptr()


class TensorMark:
    """Knows a tensor again without holding it, strongly or weakly (a weak reference to a tensor makes
    ``torch.utils.swap_tensors`` refuse it, and ``Module._apply`` swaps).

    ``id()`` and the TensorImpl's address are both reused as soon as a tensor is gone, often by the very next
    tensor made; its storage tells them apart: the weak reference to the StorageImpl kept here (which no swap
    checks) keeps that address from being reused while the mark lives. A tensor without storage (meta) is
    known by id and impl alone. With ``content=True`` the mark also stops matching once the tensor is written
    in place (its version counter moves: a cache refused while zeros, filled later); an inference tensor has
    no version counter, and is known as with ``content=False``."""

    __slots__ = ("ident", "impl", "storage", "version")

    def __init__(self, tensor: torch.Tensor, content: bool = False) -> None:
        self.ident, self.impl = id(tensor), tensor._cdata
        self.storage = StorageWeakRef(local(tensor).untyped_storage()) if has_storage(tensor) else None
        self.version = tensor._version if content and not tensor.is_inference() else None

    def matches(self, tensor: torch.Tensor) -> bool:
        if id(tensor) != self.ident or tensor._cdata != self.impl:
            return False
        if self.version is not None and tensor._version != self.version:
            return False
        if self.storage is None:
            return not has_storage(tensor)
        return has_storage(tensor) and local(tensor).untyped_storage()._cdata == self.storage.cdata


class Origin(str, enum.Enum):
    """Where a tensor comes from: a parameter, buffer or tensor attribute of a module, a global, or a forward input."""

    PARAMETER = "parameter"
    BUFFER = "buffer"
    ATTRIBUTE = "attribute"  # a plain tensor attribute of a module (GPT-J's embed_positions)
    GLOBAL = "global"
    INPUT = "input"  # a forward input: never module state

    def __str__(self) -> str:
        return self.value


def module_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, Origin, bool, torch.nn.Module]]:
    """(first full path, tensor, origin, saved in the state_dict, owning module) for every parameter, buffer
    and plain tensor attribute of ``model``, each tensor object once."""
    seen: set[int] = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        entries = [(name, t, Origin.PARAMETER, True) for name, t in module._parameters.items()]
        entries += [(name, t, Origin.BUFFER, name not in module._non_persistent_buffers_set)
                    for name, t in module._buffers.items()]
        entries += [(name, t, Origin.ATTRIBUTE, False) for name, t in vars(module).items() if isinstance(t, torch.Tensor)]
        for name, tensor, origin, persistent in entries:
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                yield dot + name, tensor, origin, persistent, module


def module_tensors(model: torch.nn.Module) -> dict[int, tuple[str, torch.Tensor]]:
    """id(tensor) -> (first full path, tensor) for every parameter, buffer and plain tensor attribute."""
    return {id(tensor): (path, tensor) for path, tensor, *_ in module_state(model)}


def tensor_paths(model: torch.nn.Module) -> dict[int, str]:
    """id(tensor) -> full path for every parameter, buffer and plain tensor attribute of ``model``."""
    return {ident: path for ident, (path, _) in module_tensors(model).items()}
