"""The copy options have one owner, the copy package: the config's ``copy`` section is kept as given
by the core config and parsed by ``kvtier.copy.options.CopyConfig``, and every ``CopyStrategy`` is
a strategy the CUDA backend's options (``kvtier.copy.cuda.options``) accept."""

from __future__ import annotations

import pytest

from kvtier.config import load_config
from kvtier.copy.cuda.options import CudaCopyOptions
from kvtier.copy.options import CopyConfig, CopyStrategy
from kvtier.errors import ConfigError
from kvtier.validation import Section


def test_the_config_section_is_parsed_by_the_copy_package() -> None:
    parsed = CopyConfig.parse(Section({"strategy": "staged", "max_sms": 12}, "copy"))
    assert parsed == CopyConfig(CopyStrategy.STAGED, 12)
    assert CopyConfig.parse(Section({}, "copy")) == CopyConfig()
    kept = load_config({"copy": {"strategy": "dma"}}).copy
    assert dict(kept) == {"strategy": "dma"}
    assert CopyConfig.parse_mapping(kept) == CopyConfig(CopyStrategy.DMA, 0)


@pytest.mark.parametrize(
    ("section", "field", "allowed"),
    [
        ({"strategy": "fast"}, "copy.strategy", "one of 'auto', 'dma', 'staged', 'kernel'"),
        ({"max_sms": -1}, "copy.max_sms", ">= 0"),
        ({"max_sms": True}, "copy.max_sms", "an integer"),
        ({"lanes": 2}, "copy.lanes", "not a known option"),
    ],
)
def test_a_bad_copy_section_names_the_field(
    section: dict[str, object], field: str, allowed: str
) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as raised:
        CopyConfig.parse(Section(section, "copy"))
    assert allowed in str(raised.value)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        CopyConfig.parse_mapping(load_config({"copy": section}).copy)


@pytest.mark.parametrize("strategy", list(CopyStrategy))
def test_every_strategy_reaches_the_cuda_options(strategy: CopyStrategy) -> None:
    config = load_config({"copy": {"strategy": strategy.value, "max_sms": 4}})
    options = CudaCopyOptions.from_copy(CopyConfig.parse_mapping(config.copy), False, stage_lanes=3)
    assert (options.strategy, options.max_sms, options.stage_lanes) == (strategy.value, 4, 3)


def test_cuda_options_accept_only_the_strategies_the_config_knows() -> None:
    with pytest.raises(ConfigError, match=r"copy\.strategy.*one of auto, dma, staged, kernel"):
        CudaCopyOptions(strategy="fast")
    assert [CudaCopyOptions(strategy=s.value).strategy for s in CopyStrategy] == [
        "auto",
        "dma",
        "staged",
        "kernel",
    ]
