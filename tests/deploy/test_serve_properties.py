"""A property of the server, checked on requests generated from its own request schema (the JSON
Schema its OpenAPI document publishes): whatever a client sends, the answer is a 200 or a JSON 4xx
or 503, never a 500, on either engine."""

from __future__ import annotations

import collections
import json

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="a [dev] dependency: pip install -e '.[dev]'")
pytest.importorskip("fastapi", reason="optional extra: pip install -e '.[serve]' (included in [dev])")
pytest.importorskip("ctranslate2", reason="optional extra: pip install -e '.[export]' (included in [dev])")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from seq2seq.inference.translator import Translator  # noqa: E402

# Text a client might send: the tiny model's words, spaces and line breaks, digits, characters that
# grow under NFKC (U+FDFA: one character, 18 after normalisation), a script the vocabulary lacks, and
# a lone surrogate (JSON's \ud800 escape parses to one; UTF-8 cannot carry it).
WORDS = st.sampled_from(
    ["the", "cat", "sleeps", "la", "nugati", " ", "\n", "\t", "7", "\ufdfa", "\ua66e", "é", "", "\ud800"]
)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5)
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)
LIMITS = {"max_lines": 3, "max_chars": 40, "max_tokens_per_line": 24, "max_work": 20_000, "max_constraints": 2,
          "batch_wait": 0.0, "decode_maxima": {"beam": 4, "nbest": 4, "patience": 2.0, "max_len_a": 2.0,
                                               "max_len_b": 20, "no_repeat_ngram": 4}}  # fmt: skip


def text(schema: dict) -> st.SearchStrategy:
    most = schema.get("maxLength", 20) + 3  # a little past the limit too
    return st.lists(WORDS, max_size=12).map("".join).filter(lambda t: len(t) <= most)


def value(schema: dict, odd: int = 20) -> st.SearchStrategy:
    """A value of the schema's type, mostly where settings are plausible (so that requests get past
    the checks into the engine), sometimes past its bounds, once in `odd` of any JSON type at all."""
    kind = schema.get("type")
    if "enum" in schema:
        right = st.sampled_from(schema["enum"]) | st.text(max_size=6)
    elif kind == "integer":
        low = schema.get("minimum", 0)
        high = min(schema.get("maximum", schema.get("exclusiveMaximum", 9) - 1), low + 8)
        beyond = st.integers(low - 2, high + 2) | st.sampled_from([2**32, 2**63, -(2**63)])
        right = rarely(beyond, odd=8, otherwise=st.integers(low, high))
    elif kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum", 0.0))
        high = schema.get("maximum", schema.get("exclusiveMaximum", 2.0))
        beyond = st.floats(low - 1.0, high + 1.0) | st.sampled_from([low, high, float("nan"), float("inf")])
        inside = st.floats(low, min(high, low + 3.0), exclude_min="exclusiveMinimum" in schema,
                           exclude_max="exclusiveMaximum" in schema and high <= low + 3.0)  # fmt: skip
        right = rarely(beyond, odd=8, otherwise=inside)
    elif kind == "boolean":
        right = st.booleans()
    elif kind == "string":
        right = text(schema)
    else:  # an array: its items rarely of another type (the array itself sometimes is), now and then too long
        most = schema.get("maxItems", 3)
        right = rarely(st.lists(value(schema["items"]), min_size=most + 1, max_size=most + 1), odd=10,
                       otherwise=st.lists(value(schema["items"], odd=60), min_size=1, max_size=most))  # fmt: skip
    return rarely(ANY_JSON, odd=odd, otherwise=right)


def rarely(strategy: st.SearchStrategy, *, odd: int, otherwise: st.SearchStrategy) -> st.SearchStrategy:
    """`strategy` once in about `odd` draws, else `otherwise`. (Hypothesis leans towards the ends of a
    range when it draws an integer, so the rare case sits in the middle of the choices.)"""
    choices = [False] * (odd // 2) + [True] + [False] * (odd - 1 - odd // 2)
    return st.sampled_from(choices).flatmap(lambda rare: strategy if rare else otherwise)


@st.composite
def requests(draw, schema: dict) -> dict:
    """A body of the schema's properties: the required ones nearly always, each other one now and
    then; lists that go with the first (lines, sources) mostly as long as it."""
    properties, body = schema["properties"], {}
    for name in schema["required"]:
        if not draw(rarely(st.just(True), odd=20, otherwise=st.just(False))):  # missing, once in 20
            body[name] = draw(value(properties[name]))
    first = body.get(schema["required"][0])
    for name in sorted(set(properties) - set(schema["required"])):
        if not draw(st.sampled_from([False, False, True, False, False, False, True, False, False, False])):
            continue  # each optional field in 2 requests of 10
        if isinstance(first, list) and properties[name].get("type") == "array" and draw(st.booleans()):
            body[name] = [draw(value(properties[name]["items"])) for _ in first]  # one per line
        else:
            body[name] = draw(value(properties[name]))
    if draw(rarely(st.just(True), odd=30, otherwise=st.just(False))):
        body[draw(st.text(max_size=4))] = draw(ANY_JSON)  # a field the schema does not know
    return body


@pytest.fixture(scope="module", params=["pytorch", "ctranslate2"])
def client(request, trained_checkpoint, tmp_path_factory):
    from fastapi.testclient import TestClient

    from seq2seq.deploy.export import export_checkpoint
    from seq2seq.deploy.requests import Limits
    from seq2seq.deploy.serve import create_app

    path = trained_checkpoint[0]
    if request.param == "ctranslate2":
        path = tmp_path_factory.mktemp("property") / "model"
        export_checkpoint(trained_checkpoint[0], path, check_lines=10)
    translator = Translator.load(path, device="cpu")
    with TestClient(create_app(translator, model_name=request.param, limits=Limits(**LIMITS))) as test_client:
        yield test_client


def check_answer(client, route: str, body: dict) -> int:
    response = client.post(route, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert response.status_code == 200 or 400 <= response.status_code < 500 or response.status_code == 503, (
        body,
        response.text,
    )
    answer = response.json()
    if response.status_code != 200:
        assert isinstance(answer["error"], str) and answer["error"]
    elif route == "/translate":
        assert len(answer["translations"]) == len(body["lines"])
    else:
        assert len(answer["scores"]) == len(body["sources"])
    return response.status_code


EXAMPLES = {"/translate": 300, "/score": 100}


@pytest.mark.parametrize("route", ["/translate", "/score"])
def test_every_answer_is_a_200_or_a_json_4xx_or_503_never_a_500(client, route):
    schema = client.get("/openapi.json").json()["paths"][route]["post"]["requestBody"]["content"]["application/json"]
    answers = []

    @settings(max_examples=EXAMPLES[route], deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
    @given(requests(schema["schema"]))
    def property_holds(body):
        answers.append(check_answer(client, route, body))

    property_holds()
    statuses = collections.Counter(answers)
    assert statuses[200] >= 10 and sum(statuses.values()) >= EXAMPLES[route]  # many got into the engine
