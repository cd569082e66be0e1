"""The package plugin's tier: the dict tier's storage under its own kind and options."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.keys import Namespace
from kvtier.pool import HostPool
from kvtier.validation import Section
from plugin_examples.dict_tier import DictTier
from plugin_examples.dict_tier import Options as DictOptions


@dataclass(frozen=True, slots=True)
class Options:
    boxes: int = 4

    @classmethod
    def parse(cls, section: Section) -> Options:
        options = cls(boxes=section.integer("boxes", 4, minimum=1))
        section.done()
        return options


class BoxTier(DictTier):
    kind = "box_tier"
    Options = Options  # type: ignore[assignment]

    def __init__(self, name: str, namespace: Namespace, pool: HostPool, options: Options) -> None:
        super().__init__(
            name, namespace, pool, DictOptions(capacity_blocks=options.boxes, threads=0)
        )
        self.boxes = options.boxes
