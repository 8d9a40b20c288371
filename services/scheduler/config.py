"""Scheduler configuration (``STRATA_*`` env vars or mirroring ``--flags``)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from services.scheduler.autoscale import ScaleConfig
from services.scheduler.degrade import DegradeThresholds
from services.scheduler.planner import PlannerConfig
from services.scheduler.policies import POLICY_NAMES
from services.scheduler.types import CostModel
from shared.config import KVEventStreamConfig


class SchedulerConfig(KVEventStreamConfig):
    policy: str = Field("least_loaded", description=f"Routing policy: {' | '.join(POLICY_NAMES)}")
    load_interval: float = Field(0.5, gt=0, description="Expected seconds between load reports")
    down_after: int = Field(3, ge=1, description="Missed load reports before an instance is down")
    state_interval: float = Field(0.5, gt=0, description="Seconds between SchedulerState publishes")
    block_size: int = Field(
        16, ge=1, description="Tokens per KV block (until reports say otherwise)"
    )
    transfer_mode: str = Field(
        "direct",
        pattern="^(direct|pool)$",
        description="KV transfer mode put in route replies: direct | pool",
    )
    long_instances: list[str] = Field(
        [],
        description="Comma-separated prefill instances reserved for "
        "very long prompts (prefix_aware)",
    )
    long_prompt_tokens: int = Field(32768, ge=1, description="Prompt length that counts as long")
    short_prompt_tokens: int = Field(
        512,
        ge=0,
        description="Uncached prompt shorter than this "
        "prefills on the decode instance (prefix_aware)",
    )
    affinity_imbalance: float = Field(
        0.25, ge=0, description="Decode load-score gap that breaks cache affinity (prefix_aware)"
    )
    affinity_load_bound: float = Field(
        1.5,
        ge=0,
        description="A prefill cache holder keeps a prompt while its queue is at most this x "
        "the mean queue (prefix_aware; 0 = minimum predicted TTFT only)",
    )
    affinity_slack_s: float = Field(
        4.0,
        ge=0,
        description="... or at most this many queue seconds above the shortest (prefix_aware)",
    )
    slo_interactive_ms: float = Field(
        0.0,
        ge=0,
        description="Default TTFT SLO of the interactive class in ms (0 = no early rejection)",
    )
    slo_batch_ms: float = Field(0.0, ge=0, description="Default TTFT SLO of the batch class in ms")
    prefill_tokens_per_s: float = Field(
        8000.0, gt=0, description="Prefill rate assumed for an instance that reports none"
    )
    dram_tokens_per_s: float = Field(200000.0, gt=0, description="Pool DRAM-tier KV load rate")
    ssd_tokens_per_s: float = Field(40000.0, gt=0, description="Pool SSD-tier KV load rate")
    degrade_up: list[float] = Field(
        [0.8, 0.9, 0.97], description="Cluster load entering levels 1,2,3 (comma-separated)"
    )
    degrade_down: list[float] = Field(
        [0.7, 0.82, 0.9], description="Cluster load leaving levels 1,2,3 (comma-separated)"
    )
    degrade_dwell_s: float = Field(
        2.0, ge=0, description="Least seconds at a level before stepping down"
    )
    queue_target_s: float = Field(2.0, gt=0, description="Prefill queue time counted as load 1.0")
    batch_norm: float = Field(64.0, gt=0, description="Running seqs counted as decode load 1.0")
    batch_max_tokens_cap: int = Field(
        256, ge=1, description="max_tokens cap of the batch class at degradation level >= 1"
    )
    top_priority: int = Field(
        0,
        description="At level 3 only priority <= this is admitted (lower number = more important)",
    )
    retry_after_s: float = Field(5.0, gt=0, description="Retry-After of degradation refusals")
    snapshot_interval: float = Field(
        30.0, ge=0, description="Seconds between prefix-index snapshots (0 = never snapshot)"
    )
    snapshot_min_events: int = Field(
        10000, ge=1, description="KV events applied since the last snapshot before another"
    )
    snapshot_purge: bool = Field(
        True,
        description="After each snapshot, purge from the KV-event stream the events this "
        "replica's previous snapshot covered (the stream then holds about one snapshot "
        "interval of events)",
    )
    expect_ttl_s: float = Field(
        30.0,
        ge=0,
        description="Seconds a routed prompt's blocks count as cached on its prefill instance "
        "before their KV event arrives (0 = wait for the event)",
    )

    autopd: bool = Field(
        False,
        description="AutoPD: flip instances between prefill and decode as their load ratio "
        "moves (services/scheduler/planner.py)",
    )
    autopd_ratio: float = Field(
        3.0, gt=1, description="AutoPD: pressure ratio (busy role / other) that calls for a flip"
    )
    autopd_min_pressure: float = Field(
        0.5, ge=0, description="AutoPD: least pressure of the busy role before it gains one"
    )
    autopd_hold_ticks: int = Field(
        4, ge=1, description="AutoPD: state ticks the ratio must hold before a flip"
    )
    autopd_cooldown_ticks: int = Field(
        20, ge=0, description="AutoPD: state ticks after a flip before another"
    )

    autoscale: bool = Field(
        False,
        description="Autoscaling: size the prefill and decode fleets from their load against the "
        "SLO targets, retire (drain, then exit) instances beyond the need, and export the need "
        "as strata_scheduler_desired_instances (services/scheduler/autoscale.py)",
    )
    autoscale_retire: bool = Field(
        True,
        description="Autoscaling: retire the instances beyond the need (strata up); off: only "
        "export the need, for Kubernetes, where KEDA or an HPA scales the Deployments on "
        "strata_scheduler_desired_instances and a removed pod drains in its preStop hook",
    )
    autoscale_min_decode: int = Field(1, ge=1, description="Autoscaling: fewest decode instances")
    autoscale_max_decode: int = Field(4, ge=1, description="Autoscaling: most decode instances")
    autoscale_min_prefill: int = Field(0, ge=0, description="Autoscaling: fewest prefill instances")
    autoscale_max_prefill: int = Field(
        0, ge=0, description="Autoscaling: most prefill instances (0: prefill is not scaled)"
    )
    autoscale_utilization: float = Field(
        0.7, gt=0, le=1, description="Autoscaling: pressure per instance the fleet is sized for"
    )
    tpot_target_s: float = Field(
        0.1, gt=0, description="Engine step seconds (time per output token) counted as load 1.0"
    )
    autoscale_up_ticks: int = Field(
        4, ge=1, description="Autoscaling: state ticks the need must exceed the fleet before an add"
    )
    autoscale_down_ticks: int = Field(
        20, ge=1, description="Autoscaling: state ticks the need must stay under it before a retire"
    )
    autoscale_cooldown_ticks: int = Field(
        20, ge=0, description="Autoscaling: state ticks after a decision before another"
    )
    autoscale_lookahead_ticks: int = Field(
        0,
        ge=0,
        description="Autoscaling: size for the load expected this many state ticks ahead (about "
        "an instance's start time) from its rising trend; 0 = the load now",
    )

    @model_validator(mode="after")
    def _scale_bounds(self) -> SchedulerConfig:
        for role in ("decode", "prefill"):
            lo, hi = getattr(self, f"autoscale_min_{role}"), getattr(self, f"autoscale_max_{role}")
            if lo > hi:
                raise ValueError(f"autoscale_min_{role} {lo} is above autoscale_max_{role} {hi}")
        return self

    def scale_config(self) -> ScaleConfig:
        return ScaleConfig(
            min_prefill=self.autoscale_min_prefill,
            max_prefill=self.autoscale_max_prefill,
            min_decode=self.autoscale_min_decode,
            max_decode=self.autoscale_max_decode,
            utilization=self.autoscale_utilization,
            ttft_s=self.queue_target_s,
            tpot_s=self.tpot_target_s,
            batch_norm=self.batch_norm,
            up_ticks=self.autoscale_up_ticks,
            down_ticks=self.autoscale_down_ticks,
            cooldown_ticks=self.autoscale_cooldown_ticks,
            default_rate=self.prefill_tokens_per_s,
            lookahead_ticks=self.autoscale_lookahead_ticks,
        )

    @field_validator("degrade_up", "degrade_down")
    @classmethod
    def _three_floats(cls, v: list[float]) -> list[float]:
        if len(v) != 3:
            raise ValueError("needs three comma-separated numbers")
        return v

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        if v not in POLICY_NAMES:
            raise ValueError(f"unknown policy; choose one of {', '.join(POLICY_NAMES)}")
        return v

    def thresholds(self) -> DegradeThresholds:
        return DegradeThresholds(
            up=tuple(self.degrade_up),
            down=tuple(self.degrade_down),
            min_dwell_s=self.degrade_dwell_s,
        )

    def planner_config(self) -> PlannerConfig:
        return PlannerConfig(
            ratio=self.autopd_ratio,
            min_pressure=self.autopd_min_pressure,
            hold_ticks=self.autopd_hold_ticks,
            cooldown_ticks=self.autopd_cooldown_ticks,
            queue_target_s=self.queue_target_s,
            batch_norm=self.batch_norm,
        )

    def cost_model(self) -> CostModel:
        return CostModel(
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            dram_tokens_per_s=self.dram_tokens_per_s,
            ssd_tokens_per_s=self.ssd_tokens_per_s,
        )

    def policy_options(self) -> dict:
        if self.policy != "prefix_aware":
            return {}
        return dict(
            short_prompt_tokens=self.short_prompt_tokens,
            long_prompt_tokens=self.long_prompt_tokens,
            affinity_imbalance=self.affinity_imbalance,
            batch_norm=self.batch_norm,
            affinity_load_bound=self.affinity_load_bound,
            affinity_slack_s=self.affinity_slack_s,
        )

    def long_instance_set(self) -> frozenset[str]:
        return frozenset(self.long_instances)
