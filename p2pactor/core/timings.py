"""The timers of the P2P protocol, in seconds.

Defaults are vLLM 0.33.0's constants (``vllm-p2p-0.33.md`` §1.8), so a p2pactor
node and a stock vLLM node time out on each other the same way. Deadlines are
computed from these and stored as absolute times in events; the core itself
never reads a clock.
"""

from __future__ import annotations

import attrs

from p2pactor.core import checks

# A timer may be inf: never.
_positive = checks.positive(finite=False)


@attrs.frozen(kw_only=True)
class Timings:
    """Protocol timers.

    Attributes:
        load_timeout: A fetch unanswered this long is aborted (consumer).
        abort_ack_timeout: An abort unacknowledged this long fails the load
            anyway (consumer).
        lookup_progress_timeout: A lookup that resolves no key for this long
            fails its request (consumer). vLLM tears the whole session down at
            this point; we fail only the request.
        pending_timeout: HIT_PENDING/RETRY keys still unresolved this long
            after the lookup arrived are answered MISS and never pinned
            (producer).
        pending_poll_interval: How often the producer asks the parent again
            about HIT_PENDING/RETRY keys. vLLM asks at every serve (each engine
            step, and every 1 ms on its tier-poll thread).
        pin_timeout: A pin that no fetch has used for this long is released
            (producer). Each lookup or fetch of the request renews every pin it
            holds to this long from then (a lease; vLLM never renews).
        pin_lease_cap: Renewals never keep a request's pins past this long after
            its first pin (producer).
    """

    load_timeout: float = attrs.field(default=30.0, validator=_positive)
    abort_ack_timeout: float = attrs.field(default=10.0, validator=_positive)
    lookup_progress_timeout: float = attrs.field(default=30.0, validator=_positive)
    pending_timeout: float = attrs.field(default=5.0, validator=_positive)
    pending_poll_interval: float = attrs.field(default=0.005, validator=_positive)
    pin_timeout: float = attrs.field(default=30.0, validator=_positive)
    pin_lease_cap: float = attrs.field(default=600.0, validator=_positive)


# vLLM 0.33.0's timers.
DEFAULT_TIMINGS = Timings()
