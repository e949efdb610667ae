"""A translated dialect request planned exactly as a chat request is (`plan_request`)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import structlog

from gateway.dialects import PlanInput
from gateway.rewrite import RequestPlan, plan_request
from gateway.translate.common import Translated

events = structlog.get_logger("gateway")


@dataclass(frozen=True)
class TranslatedPlan(RequestPlan):
    """A `RequestPlan` that remembers the dialect request it came from (`Translated`)."""

    translated: Translated | None = None


def plan_translated(given: PlanInput, translated: Translated) -> TranslatedPlan:
    """Plan the chat body of a translated request exactly as a chat request is planned."""
    if translated.dropped_tools:
        events.debug("tools_dropped", tools=translated.dropped_tools[:20])
    base = plan_request(
        translated.chat,
        "chat",
        settings=given.settings,
        tenant=given.tenant,
        request_id=given.request_id,
        salt_secret=given.salt_secret,
        output_cap=translated.requested_output,
    )
    values = {f.name: getattr(base, f.name) for f in fields(RequestPlan)}
    return TranslatedPlan(**values, translated=translated)
