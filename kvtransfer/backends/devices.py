"""Which device a backend's KV buffers live on, as peers can compare it (sent in ``endpoint()``)."""

from __future__ import annotations

import torch


def memory_kind(device: torch.device) -> str:
    """"cpu" or "cuda": the kind of memory a peer's buffers are in."""
    return device.type


def device_identity(device: torch.device) -> str:
    """A host-independent identity of a CUDA device (its UUID; PCI address where torch has no UUID); "" on CPU.

    Indices cannot be compared across processes (each may see its own ``CUDA_VISIBLE_DEVICES``); UUIDs can.
    """
    if device.type != "cuda":
        return ""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return str(uuid)
    return f"pci:{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}"
