"""Python backends for the tests (tests/producers/python.rs): one that works, and one per way to fail.

Each reads the model's shape from the config the host passes, so it works on any model; its K/V is a
stand-in (a fixed function of layer, K or V, token, position, head and dim), not the model's.
"""

import ctypes
import struct
# Imported whole now: a backend runs confined after `open`, and `concurrent.futures` loads its executors
# lazily, from files the confined process may no longer open.
from concurrent.futures import ThreadPoolExecutor


def _shape(config):
    """(layer kinds string, kv_heads, head_dim, window) from the host's config keys."""
    return config["layers"], config["kv_heads"], config["head_dim"], config.get("window", 0)


def _value(layer, kind, token, pos, head, dim):
    h = 1469598103934665603
    for part in (layer, kind, token, pos, head, dim):
        h = ((h ^ part) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return (h >> 40) / float(1 << 23) - 1.0


class StandIn:
    """Dense f32 K/V of the stand-in, written into the regions in place."""

    head_dim_offset = 0

    def open(self, config):
        self.layers, self.kv_heads, self.head_dim, self.window = _shape(config)
        self.released = []

    def describe(self):
        layers = []
        for letter in self.layers:
            kind = "sliding" if letter == "S" else "full"
            layers.append({"kind": kind, "kv_heads": self.kv_heads,
                           "head_dim": self.head_dim + self.head_dim_offset, "window": self.window})
        return {"layout": "dense", "dtype": "f32", "layers": layers}

    def values(self, entry, tokens, start):
        layer, kind = divmod(entry, 2)
        return [_value(layer, kind, t, start + i, h, d)
                for i, t in enumerate(tokens) for h in range(self.kv_heads) for d in range(self.head_dim)]

    def fill(self, writer, entry, tokens, start):
        """Writes entry `entry`'s values into its region, and returns the region."""
        region = writer.region(entry)
        values = self.values(entry, tokens, start)
        struct.pack_into("<%df" % len(values), region, 0, *values)
        return region

    def prefill(self, request, tokens, start, writer):
        for entry in range(writer.entries):
            self.fill(writer, entry, tokens, start)

    def release(self, request):
        self.released.append(request)


class StagesOnly(StandIn):
    """Computes a span's values only in `stage`: its `prefill` writes what was staged and refuses a call
    that was not (so a batch through it proves `stage` ran, and a call alone fails)."""

    def open(self, config):
        super().open(config)
        self.staged = {}

    def stage(self, calls):
        for request, tokens, start, context in calls:
            self.staged[(request, start)] = [self.values(e, tokens, start) for e in range(2 * len(self.layers))]

    def prefill(self, request, tokens, start, writer):
        staged = self.staged.pop((request, start), None)
        if staged is None:
            raise RuntimeError("request %d at %d was not staged" % (request, start))
        for entry in range(writer.entries):
            region = writer.region(entry)
            struct.pack_into("<%df" % len(staged[entry]), region, 0, *staged[entry])


class NeedsAKey(StandIn):
    """Reads a config key the host never sends: a config this class cannot use, the same on every start."""

    def open(self, config):
        super().open(config)
        self.device = config["device_index"]


class Raises(StandIn):
    def prefill(self, request, tokens, start, writer):
        raise ValueError("the device is not there")


class RaisesAfterWriting(StandIn):
    def prefill(self, request, tokens, start, writer):
        region = writer.region(0)
        region[:4] = bytes(4)
        raise ValueError("failed after writing")


class Hangs(StandIn):
    def prefill(self, request, tokens, start, writer):
        while True:
            pass


class WrongShape(StandIn):
    head_dim_offset = 1


class MissingWindow(StandIn):
    """Describes its sliding layers without the window they need."""

    def describe(self):
        described = super().describe()
        for layer in described["layers"]:
            if layer["kind"] == "sliding":
                del layer["window"]
        return described


class ShortWrite(StandIn):
    def prefill(self, request, tokens, start, writer):
        for entry in range(writer.entries):
            region = writer.region(entry)
            values = self.values(entry, tokens, start)
            if entry == writer.entries - 1:
                values = values[: len(values) // 2]
            struct.pack_into("<%df" % len(values), region, 0, *values)


class KeepsAView(StandIn):
    """Keeps a view into a region past prefill: refused, since it would reach a slot the host owns."""

    def fill(self, writer, entry, tokens, start):
        region = super().fill(writer, entry, tokens, start)
        if entry == 0:
            self.kept = region.cast("f")
        return region


class KeepsAnAddress(StandIn):
    """Takes a region's address and keeps the memoryview, releasing the export at once, as
    `torch.frombuffer` does: refused, since the address still reaches the slot after the call."""

    def fill(self, writer, entry, tokens, start):
        region = super().fill(writer, entry, tokens, start)
        if entry == 0:
            self.address = ctypes.addressof(ctypes.c_char.from_buffer(region))
            self.kept = region
        return region


class FillsFromThreads(StandIn):
    """Fills the regions from a pool of threads, as the ABI allows: the same bytes as `StandIn`."""

    def prefill(self, request, tokens, start, writer):
        with ThreadPoolExecutor(max_workers=3) as pool:
            list(pool.map(lambda entry: self.fill(writer, entry, tokens, start).release(), range(writer.entries)))


class KeepsTheRegion(StandIn):
    """Keeps a region itself (a view's `.obj`, not the view) past prefill and views it again in the next
    call: refused there, since the slot under it may be the host's, or another call's, by then."""

    def prefill(self, request, tokens, start, writer):
        if hasattr(self, "kept"):
            memoryview(self.kept)[:4] = bytes(4)
        super().prefill(request, tokens, start, writer)

    def fill(self, writer, entry, tokens, start):
        region = super().fill(writer, entry, tokens, start)
        if entry == 0:
            self.kept = region.obj
        return region
