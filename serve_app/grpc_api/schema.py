"""The message and service modules of `pagedserve.proto`, built from the shipped file at run time
(no generated code in the tree), once per process."""
from __future__ import annotations

import functools
import sys
import threading
from pathlib import Path
from types import ModuleType

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILE = "pagedserve.proto"
SERVICE_NAME = "pagedserve.v1.Generate"

_lock = threading.Lock()


@functools.cache
def modules() -> tuple[ModuleType, ModuleType]:
    """(messages, services): `pagedserve_pb2` and `pagedserve_pb2_grpc` as protoc would write them."""
    import grpc

    # protos_and_services finds the file on sys.path; the folder is there only while it looks, so
    # the proto's top-level module names are never importable by accident.
    with _lock:
        sys.path.insert(0, str(PROTO_DIR))
        try:
            return grpc.protos_and_services(PROTO_FILE)
        finally:
            sys.path.remove(str(PROTO_DIR))
