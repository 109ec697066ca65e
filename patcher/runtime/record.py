"""The record a verify leaves on its cache, for the commit that follows."""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field

from .caches import _cache_length
from .errors import _uncertain
from .tree import _TreePlan


# Attribute names this module sets on cache objects. A record travels with the cache it
# describes, so several concurrent generations never see each other's records.
_RECORD_ATTR = "_ddpatch_record"


_WARNED_ATTR = "_ddpatch_warned"


_NO_STATE_WARNING = (
    "ddpatch: tokens were cropped from a cache with Gated DeltaNet (linear attention) layers, "
    "but no verify was recorded for it (call the target through verify_forward), so the Gated "
    "DeltaNet state was not rolled back and the output may diverge from the target's own decoding."
)


@dataclass
class _Record:
    mode: str  # "chain" or "tree"
    past_len: int  # attention length before the verify
    length: int  # tokens in the verify window
    modules: tuple  # ((layer_idx, gdn_module), ...)
    inputs: dict = field(default_factory=dict)  # layer_idx -> (hidden_states [B, L, H], 2D mask or None)
    snapshot: dict = field(default_factory=dict)  # layer_idx -> _Snapshot (chain only)
    plan: _TreePlan | None = None  # tree only
    settled: int | None = None  # after a commit: the length the GDN state now corresponds to
    fast: dict = field(default_factory=dict)  # layer_idx -> _FastCapture (the Gated DeltaNet fast path)
    counts: dict = field(default_factory=dict)  # layer_idx -> 5.25+ linear token count before the verify
    inflight: bool = False  # set before the verify's forward, cleared once it returned
    lost: bool = False  # a copy (deepcopy, pickle) of a record that was not committed
    owner: str = "target"  # whose cache this is, for the messages (``lossless`` names an assistant's)

    def __reduce_ex__(self, protocol):
        """A copied cache gets neither the captured activations nor the modules: a committed
        record is copied as committed, an uncommitted one as *lost* (its copy cannot be committed
        exactly, and any commit on it raises)."""
        return (_copied_record, (self.mode, self.past_len, self.length, self.settled, self.settled is None))


def _copied_record(mode, past_len, length, settled, lost) -> _Record:
    return _Record(mode, past_len, length, (), settled=settled, lost=lost)


def _get_record(cache) -> _Record | None:
    return getattr(cache, _RECORD_ATTR, None)


def _set_record(cache, record: _Record | None) -> None:
    setattr(cache, _RECORD_ATTR, record)


def _usable(cache, record: _Record | None) -> _Record | None:
    """``record`` unless it cannot be committed exactly (a copy's, or one whose forward raised):
    then it is dropped, and that raises (or warns, by ``options.ON_UNCERTAIN``)."""
    if record is None:
        return None
    if record.lost:
        _set_record(cache, None)
        _uncertain(
            "ddpatch: this cache is a copy (copy.deepcopy or pickle) of a cache whose verify was not committed yet; "
            "the record stays with the original, so the copy cannot be committed exactly; commit (crop) before copying"
        )
        return None
    if record.inflight:
        _set_record(cache, None)
        _uncertain(
            "ddpatch: a verify forward on this cache raised before it returned, so its linear-attention state may "
            "hold part of that verify; start again from a fresh cache (or one saved before the verify)"
        )
        return None
    return record


def _pending_record(cache) -> _Record | None:
    """The cache's record if it still awaits a commit.

    A record whose cache no longer has the verify's length was cut back by something that
    did not commit it (a helper that sliced the key/value tensors itself, say): the recurrent
    state still holds the rejected tokens and nothing can make it exact any more, so this
    raises instead of letting the decoder continue on a wrong state.
    """
    record = _usable(cache, _get_record(cache))
    if record is None or record.settled is not None:
        return None
    current = _cache_length(cache)
    if current != record.past_len + record.length:
        _set_record(cache, None)
        raise RuntimeError(
            f"ddpatch: the {record.owner} cache was cut back from {record.past_len + record.length} to {current} tokens "
            "without committing the recorded verify, so its recurrent (linear-attention) state still holds the "
            "rejected tokens; cut it back with cache.crop(-n), crop_cache, compact_cache or a @tree_commit function"
        )
    return record


def _check_settled(cache) -> None:
    """At the next verify: a committed record must still match the cache's length. A key/value
    cache sliced by hand after ``tree_commit``, or a layer-by-layer crop whose attention count
    differs from the linear layers' one, leaves them apart."""
    record = _get_record(cache)
    if record is None or record.settled is None or record.lost:
        return
    current = _cache_length(cache)
    if current != record.settled:
        _set_record(cache, None)
        _uncertain(
            f"ddpatch: the target cache holds {current} tokens, but its recurrent (linear-attention) state was "
            f"committed for {record.settled}; something cut the key/value cache differently from the commit"
        )


def _warn_once(cache, message: str = _NO_STATE_WARNING) -> None:
    if getattr(cache, _WARNED_ATTR, False):
        return
    try:
        setattr(cache, _WARNED_ATTR, True)
    except AttributeError:
        pass
    # Once per *cache*: warnings.warn would also show it once per code location and process (its
    # registry), so a second cache cropped on the same line would never be warned about.
    package = __name__.rpartition(".")[0]
    frame = sys._getframe(1)
    while frame.f_back is not None and str(frame.f_globals.get("__name__", "")).startswith(package + "."):
        frame = frame.f_back
    warnings.warn_explicit(message, RuntimeWarning, frame.f_code.co_filename, frame.f_lineno,
                           module=frame.f_globals.get("__name__"), registry=None)
