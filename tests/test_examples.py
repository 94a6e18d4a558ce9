"""The shipped examples (``examples/request_<profile>.json``) materialize on the
built-in profile they are named after, and the default profile of ``mmadmit serve``
(what ``make run`` serves) has one: a new user's first ``mmadmit-client admit``
of an example against ``make run`` is materialized, never refused.

Run with: python -m pytest tests/test_examples.py -q -p no:cacheprovider
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from mmadmit.config import build_config
from mmadmit.materializer import Materializer
from mmadmit.model import Materialized
from mmadmit.profile import PRESETS, load_profile
from mmadmit.wire import decode_message
from mmadmit_client._cli_request import request_from_json
from mmadmit_client.wire import encode_add

EXAMPLES = REPO_ROOT / "examples"
PREFIX = "request_"


def examples() -> list[Path]:
    return sorted(EXAMPLES.glob(f"{PREFIX}*.json"))


def test_the_default_profile_has_an_example() -> None:
    default = build_config({}, environ={}).model
    assert (EXAMPLES / f"{PREFIX}{default}.json").is_file(), (
        f"`make run` serves {default!r}; ship examples/{PREFIX}{default}.json"
    )


@pytest.mark.parametrize("path", examples(), ids=lambda p: p.stem)
def test_each_example_materializes_on_its_profile(path: Path) -> None:
    profile_name = path.stem.removeprefix(PREFIX)
    assert profile_name in PRESETS, f"{path.name}: {profile_name!r} is not a built-in profile"
    req = request_from_json(json.loads(path.read_text()), base_dir=path.parent)
    # as the client sends it over ZMQ, as the service decodes it
    decoded = decode_message(encode_add(req)).request
    assert decoded is not None
    outcome = Materializer(load_profile(profile_name)).run(decoded)
    assert isinstance(outcome, Materialized), outcome
    assert outcome.request.mm is not None and outcome.request.mm.mrope_positions is not None
