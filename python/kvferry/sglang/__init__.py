"""kvferry as an SGLang transfer backend: ``--disaggregation-transfer-backend kvferry``.

SGLang loads this package's plugin (entry point group ``sglang.srt.plugins``, name ``kvferry``)
in every one of its processes before it parses arguments. :func:`register` adds ``kvferry`` to
SGLang's transfer backends and answers SGLang's class lookups for it with the classes of
``backend.py`` (the manager, sender and receiver, which run a kvferry agent over SGLang's own KV
buffers) and ``bootstrap.py`` (the bootstrap server, a kvferry registry on SGLang's bootstrap
port), and hands each sender and receiver its request's prompt, which SGLang does not (so that
both sides send its digest). Nothing else of SGLang changes. docs/sglang.md has the commands.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

logger = logging.getLogger(__name__)

NAME = "kvferry"


def add_backend_name(backends: type[enum.Enum]) -> None:
    """Makes ``backends(NAME)`` (SGLang's closed ``TransferBackend`` enum) resolve to a member
    ``KVFERRY``, as if it had been declared: Python offers no public way to add a member."""
    if NAME in backends._value2member_map_:
        return
    member = object.__new__(backends)
    member._name_ = NAME.upper()
    member._value_ = NAME
    type.__setattr__(backends, NAME.upper(), member)
    backends._member_map_[NAME.upper()] = member
    backends._value2member_map_[NAME] = member
    backends._member_names_.append(NAME.upper())


def classes(class_type: Any) -> type | None:
    """The kvferry class SGLang asks for by its ``KVClassType``."""
    from sglang.srt.disaggregation.utils import KVClassType

    from . import backend, bootstrap

    return {
        KVClassType.MANAGER: backend.KvferryKVManager,
        KVClassType.SENDER: backend.KvferryKVSender,
        KVClassType.RECEIVER: backend.KvferryKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: bootstrap.KvferryBootstrapServer,
    }.get(class_type)


def get_kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    """SGLang's ``get_kv_class`` with ``kvferry`` answered here (KVArgs stays SGLang's). Another
    SGLang than the tested ones is refused here, when a server builds its transfer backend: its
    start fails with what to install (an error in ``register`` SGLang would only log)."""
    if getattr(transfer_backend, "value", None) == NAME:
        from sglang.version import __version__

        from .. import supported

        supported.check("sglang", __version__)
        found = classes(class_type)
        if found is not None:
            return found
    return original(transfer_backend, class_type)


def register() -> None:
    """The plugin's entry point: SGLang calls it once in each process."""
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([NAME])
    add_backend_name(TransferBackend)
    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", get_kv_class, HookType.AROUND)
    for queue in (
        "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue",
        "sglang.srt.disaggregation.decode.DecodePreallocQueue",
    ):
        HookRegistry.register(f"{queue}._init_kv_manager", with_kv_pool, HookType.AROUND)
    HookRegistry.register(
        "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.create_sender", with_sender_prompt, HookType.AROUND
    )
    HookRegistry.register(
        "sglang.srt.disaggregation.decode.DecodePreallocQueue._create_receiver_and_enqueue",
        with_receiver_prompt,
        HookType.AROUND,
    )


def with_kv_pool(original: Any, queue: Any, *args: Any, **kwargs: Any) -> Any:
    from . import backend

    return backend.with_kv_pool(original, queue, *args, **kwargs)


def with_sender_prompt(original: Any, queue: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    from . import backend

    made = original(queue, req, *args, **kwargs)
    backend.know_prompt(getattr(req, "disagg_kv_sender", None), req)
    return made


def with_receiver_prompt(original: Any, queue: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    from . import backend

    decode_req = original(queue, req, *args, **kwargs)
    backend.know_prompt(getattr(decode_req, "kv_receiver", None), req)
    return decode_req
