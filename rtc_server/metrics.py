"""Prometheus metrics, one registry per application (tests build many apps in one process)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from rtc_server.headroom import Headroom


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.sessions = Gauge(
            "avatar_rtc_sessions", "Calls currently open.", registry=self.registry
        )
        self.calls_answered = Counter(
            "avatar_rtc_calls_answered", "Calls answered since start.", registry=self.registry
        )
        self.calls_resumed = Counter(
            "avatar_rtc_calls_resumed",
            "Calls carried on over a new peer connection after their link was lost.",
            registry=self.registry,
        )
        self.video_frames = Counter(
            "avatar_rtc_video_frames_sent",
            "Video frames handed to the encoder.",
            registry=self.registry,
        )
        self.video_frames_late = Counter(
            "avatar_rtc_video_frames_late",
            "Frame instants the media path missed: 'held' when the engine had no frame ready for "
            "a speech instant (the last image was shown), 'dropped' when the video track fell "
            "behind the clock.",
            ["reason"],
            registry=self.registry,
        )
        self.audio_frames = Counter(
            "avatar_rtc_audio_frames_sent",
            "Reply audio frames sent: 'encoded' by libopus, 'replayed' when a silence long past "
            "its warm-up went out as the cached silent packet.",
            ["how"],
            registry=self.registry,
        )
        self.encode_seconds = Histogram(
            "avatar_rtc_video_encode_cpu_seconds",
            "CPU time of one H.264 frame encode.",
            buckets=(0.001, 0.002, 0.004, 0.006, 0.008, 0.012, 0.016, 0.025, 0.04, 0.08),
            registry=self.registry,
        )
        self.gc_pause = Histogram(
            "avatar_rtc_gc_pause_seconds",
            "How long each run of Python's garbage collector held the process (every call's "
            "threads wait for it), by generation.",
            ["generation"],
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16),
            registry=self.registry,
        )
        self.gc_frozen = Gauge(
            "avatar_rtc_gc_frozen_objects",
            "Objects loaded at start-up and moved out of the garbage collector's reach (its "
            "full runs walk only what calls made); 0 where the process did not freeze them.",
            registry=self.registry,
        )
        self.frame_delay = Histogram(
            "avatar_rtc_frame_send_delay_seconds",
            "How long after it was due a frame's packets left, by track (audio: its media "
            "instant; video: video_send_delay_s past it): the event loop's wake-up, and for "
            "video the encode and its thread hand-offs. What a caller sees as uneven frame "
            "arrival starts here.",
            ["kind"],
            buckets=(0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08, 0.12, 0.25),
            registry=self.registry,
        )
        self.turn_stage = Histogram(
            "avatar_rtc_turn_stage_seconds",
            "Time per stage of a turn (the turn metrics' names without _ms).",
            ["stage"],
            buckets=(0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0),
            registry=self.registry,
        )
        self.calls_refused = Counter(
            "avatar_rtc_calls_refused",
            "Offers refused with 503 at_capacity, by what was full.",
            ["reason"],
            registry=self.registry,
        )
        self.loop_lag = Gauge(
            "avatar_rtc_event_loop_lag_seconds",
            "Median of the event loop's wake-up lag over the last 5 s.",
            registry=self.registry,
        )
        self.cpu_cores = Gauge(
            "avatar_rtc_cpu_cores",
            "Cores this process used over the last 5 s.",
            registry=self.registry,
        )
        self.call_cpu_cores = Gauge(
            "avatar_rtc_call_cpu_cores",
            "Cores one call costs, as this process measured it (a prior until measured).",
            registry=self.registry,
        )
        self.speaking_call_cpu_cores = Gauge(
            "avatar_rtc_speaking_call_cpu_cores",
            "Cores one call costs while its avatar speaks, as this process measured it (a "
            "prior until measured): admission keeps room for every call speaking at once.",
            registry=self.registry,
        )
        self.utterances = Counter(
            "avatar_rtc_utterances", "Say requests accepted.", registry=self.registry
        )
        self.speculative_replies = Counter(
            "avatar_rtc_speculative_replies",
            "Replies started at a caller's pause, by outcome: used (the turn ended with those "
            "words) or discarded (the caller went on; its LLM request was made for nothing).",
            ["outcome"],
            registry=self.registry,
        )
        self.discarded_speculation_deltas = Counter(
            "avatar_rtc_discarded_speculation_deltas",
            "Text deltas (about a token each) the LLM had written for replies started at a "
            "pause and discarded, until their requests were closed: what speculation wrote "
            "for nothing.",
            registry=self.registry,
        )

        self.model_restarts = Counter(
            "avatar_rtc_model_restarts",
            "Local model processes that died and were started again.",
            registry=self.registry,
        )

    def observe_gc_pause(self, generation: int, seconds: float) -> None:
        self.gc_pause.labels(str(generation)).observe(seconds)

    def observe_load(self, headroom: Headroom) -> None:
        """Set the load gauges from what ``headroom`` measured."""
        self.loop_lag.set(headroom.loop_lag_s)
        self.cpu_cores.set(headroom.cpu_cores)
        self.call_cpu_cores.set(headroom.call_cpu)
        self.speaking_call_cpu_cores.set(headroom.speaking_call_cpu)
