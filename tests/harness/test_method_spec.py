"""Method specs: `method[option=value,...]` read into a configuration, and a recorded configuration read back."""
from __future__ import annotations

import pytest

from autosp.harness.config import RunConfig
from autosp.harness.method_spec import parse_method_spec, spec_label


@pytest.mark.parametrize("label", ["autosp", "autosp[tiling=auto:16384,offload=auto+optimizer]", "autosp[paper]",
                                   "ulysses[ac=layer]", "autosp[attention_chunks=2]"])
def test_a_recorded_configuration_is_labelled_as_the_spec_it_ran_as(label):
    cfg = parse_method_spec(label).config(RunConfig(method="-", model="tiny", seq_len=8, world_size=2, zero=3))
    assert spec_label(cfg.to_dict()) == label  # the ZeRO stage stays outside the brackets (`spec:3`)
