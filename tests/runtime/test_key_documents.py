"""A key file and a bundle's signature file are format-named JSON documents: their header is checked by
the one header check (`ir.versioned.check_header`), so a file of another kind is refused in its words."""
import json
import os

import pytest

from runtime.keys import KeyFileError, KeyPair, check_signature, read_keypair, signature_file, write_keypair


@pytest.mark.parametrize("doc, why", [
    ({"format": "confidant-signature", "name": "phone"}, "it is not a confidant-key document (its format is "
                                                         "'confidant-signature')"),
    (["confidant-key"], "it is a JSON list, not an object"),
], ids=["another-format", "not-an-object"])
def test_a_key_file_of_another_kind_is_refused_by_the_header_check(tmp_path, doc, why):
    secret, _ = write_keypair(tmp_path, KeyPair.generate("phone"))
    os.chmod(secret, 0o600)
    secret.write_text(json.dumps(doc))
    with pytest.raises(KeyFileError) as err:
        read_keypair(secret)
    assert str(err.value) == f"{secret}: not a secret key file ({why})"


def test_a_signature_file_of_another_kind_is_refused_by_the_header_check():
    pair = KeyPair.generate("coordinator")
    check_signature(pair.public, b"manifest", signature_file(pair, b"manifest"))  # as written: accepted
    doc = json.loads(signature_file(pair, b"manifest"))
    doc["format"] = "confidant-key"
    with pytest.raises(ValueError) as err:
        check_signature(pair.public, b"manifest", json.dumps(doc).encode("ascii"))
    assert str(err.value) == ("its signature file is malformed (it is not a confidant-signature document (its "
                              "format is 'confidant-key'))")
