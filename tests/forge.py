"""A pickle forger for the safe-loading tests: writes any global, opcode or nesting a crafted checkpoint
could hold (``pickle``'s own picklers refuse to name a global that does not resolve to the object saved)."""

from __future__ import annotations

import io
import pickle
import types


class G:
    """A global written as (module, name) verbatim, whatever it resolves to: how a crafted file names one."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self):  # pickle's save_reduce wants a callable
        pass


class Call:
    """``func(*args)`` at unpickling (REDUCE); ``func`` may be a G or another Call."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __call__(self):
        pass

    def __reduce__(self):
        return self.func, self.args


class Raw:
    """Opcodes written as they are."""

    def __init__(self, data: bytes):
        self.data = data


class Seq:
    """Parts written one after the other (opcodes and values, for INST/OBJ/NEWOBJ/BUILD sequences)."""

    def __init__(self, *parts):
        self.parts = parts


class Forge(pickle._Pickler):
    def save(self, obj, save_persistent_id=True):
        if isinstance(obj, G):
            if self.proto >= 4:
                self.save(obj.module)
                self.save(obj.name)
                self.write(pickle.STACK_GLOBAL)
            else:
                self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        elif isinstance(obj, Raw):
            self.write(obj.data)
        elif isinstance(obj, Seq):
            for part in obj.parts:
                self.save(part)
        else:
            super().save(obj, save_persistent_id)


FORGER = types.SimpleNamespace(__name__="forger", Pickler=Forge)
"""A ``pickle_module`` for ``torch.save``: how an attacker writes a .pt file that names any global."""


def forge(obj, proto: int) -> bytes:
    f = io.BytesIO()
    Forge(f, protocol=proto).dump(obj)
    return f.getvalue()
