"""The one header check of a versioned JSON document: each way a header can be wrong, one line naming it."""
import pytest

from ir.documents import BundleError
from ir.errors import InputFileError
from ir.versioned import HeaderError, check_header


def test_a_good_header_gives_its_version():
    assert check_header({"format": "f", "schema_version": 2}, format="f", versions=(1, 2), where="x.json") == 2
    assert check_header({"version": 1}, format=None, versions=1, version_key="version", where="x.json") == 1
    assert check_header({"format": "f"}, format="f", versions=None, version_key="version", where="x.json") is None


@pytest.mark.parametrize("doc, message", [
    ([1], "x.json is a JSON list, not an object; redo it"),
    ({"format": "g", "schema_version": 1}, "x.json is not a f document (its format is 'g'); redo it"),
    ({"schema_version": 1}, "x.json is not a f document (its format is None); redo it"),
    ({"format": "f"}, "x.json has no integer schema_version (got None); redo it"),
    ({"format": "f", "schema_version": True}, "x.json has no integer schema_version (got True); redo it"),
    ({"format": "f", "schema_version": 3}, "x.json: schema_version 3 is not supported by this build (reads 1, 2); "
                                           "redo it"),
])
def test_each_wrong_header_is_named(doc, message):
    with pytest.raises(HeaderError) as err:
        check_header(doc, format="f", versions=(1, 2), where="x.json", redo="redo it")
    assert str(err.value) == message and isinstance(err.value, InputFileError)  # a bad input: exit 2


def test_a_caller_maps_the_error_to_its_own_type():
    with pytest.raises(BundleError, match="^plan p: plan.json: schema_version 9 is not supported"):
        check_header({"schema_version": 9}, format=None, versions=1, where="plan p: plan.json", error=BundleError)
