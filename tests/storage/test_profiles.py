"""AWS named profiles (packer/storage/profiles.py): the shared files read as the AWS CLI reads them, against moto's
S3 server reached only through the profile's endpoint and keys, and the precedence and refusals."""

from __future__ import annotations

import pytest
from support.storage_servers import FAST_POLICY

from packer.errors import OptionError
from packer.storage.profiles import profile_config
from packer.storage.store import ObjectStore

NO_AWS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION",
          "AWS_ENDPOINT_URL", "AWS_ENDPOINT", "AWS_PROFILE", "AWS_DEFAULT_PROFILE")


@pytest.fixture
def aws_home(tmp_path, monkeypatch):
    """An empty ~/.aws of its own, and no AWS_* credentials in the environment."""
    for name in NO_AWS:
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    (home / ".aws").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("AWS_SHARED_CREDENTIALS_FILE", raising=False)
    monkeypatch.delenv("AWS_CONFIG_FILE", raising=False)
    return home / ".aws"


def _write(aws, credentials: str = "", config: str = "") -> None:
    (aws / "credentials").write_text(credentials)
    (aws / "config").write_text(config)


def test_a_named_profile_reaches_moto_with_its_keys_region_and_endpoint(aws_home, moto_endpoint, bucket, monkeypatch):
    """Without the profile nothing names the endpoint (the request would go to AWS, unreachable here) nor any key."""
    _write(aws_home, "[train]\naws_access_key_id = testing\naws_secret_access_key = s3cr3t-from-file\n",
           f"[profile train]\nregion = us-east-1\nendpoint_url = {moto_endpoint}\n")
    monkeypatch.setenv("AWS_PROFILE", "train")
    store = ObjectStore(f"s3://{bucket}/p", policy=FAST_POLICY)
    try:
        store.put("x", b"profile bytes")
        assert store.get("x") == b"profile bytes"
        assert "s3cr3t" not in repr(store) and "s3cr3t" not in repr(store.spec)
    finally:
        store.close()
    by_option = ObjectStore(f"s3://{bucket}/p", {"profile": "train"}, FAST_POLICY)
    monkeypatch.delenv("AWS_PROFILE")
    try:
        assert by_option.get("x") == b"profile bytes"
    finally:
        by_option.close()


def test_precedence_is_the_aws_clis(aws_home, monkeypatch):
    _write(aws_home, "[default]\naws_access_key_id = FILEKEY\naws_secret_access_key = FILESECRET\n"
                     "[other]\naws_access_key_id = OTHERKEY\naws_secret_access_key = OTHERSECRET\n",
           "[default]\nregion = eu-west-1\n[profile other]\nregion = ap-south-1\n")
    assert profile_config({}) == {"aws_access_key_id": "FILEKEY", "aws_secret_access_key": "FILESECRET",
                                  "region": "eu-west-1"}
    assert "region" not in profile_config({"region": "us-east-2"})  # an option given wins
    assert profile_config({"aws_access_key_id": "OPT", "aws_secret_access_key": "OPT"}) == {"region": "eu-west-1"}
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "ENVKEY")  # environment credentials beat the default profile's
    monkeypatch.setenv("AWS_REGION", "us-west-2")
    assert profile_config({}) == {}
    # ... but a profile named in storage_options is taken whole, as boto3.Session(profile_name=...) does
    assert profile_config({"profile": "other"}) == {"aws_access_key_id": "OTHERKEY",
                                                    "aws_secret_access_key": "OTHERSECRET", "region": "ap-south-1"}


def test_no_files_add_nothing_and_a_missing_named_profile_is_one_clear_error(aws_home, monkeypatch):
    assert profile_config({}) == {}
    with pytest.raises(OptionError, match=r"AWS profile 'nope' is in neither .*credentials nor .*config"):
        profile_config({"profile": "nope"})
    monkeypatch.setenv("AWS_PROFILE", "gone")
    with pytest.raises(OptionError, match="'gone'"):
        profile_config({})


def test_a_profile_that_would_run_something_is_refused_with_what_to_do(aws_home):
    _write(aws_home, "", "[profile sso]\nsso_session = corp\nregion = us-east-1\n"
                         "[profile proc]\ncredential_process = /usr/bin/get-creds --json\n")
    with pytest.raises(OptionError, match=r"'sso' gets its credentials through sso_session.*export-credentials"):
        profile_config({"profile": "sso"})
    with pytest.raises(OptionError, match="credential_process, which packer does not run"):
        profile_config({"profile": "proc"})
    # keys given explicitly: the profile's region is still used, nothing is run
    assert profile_config({"profile": "sso", "aws_access_key_id": "K", "aws_secret_access_key": "S"}) == {
        "region": "us-east-1"}


def test_files_named_by_the_environment_are_read(tmp_path, aws_home, monkeypatch):
    creds = tmp_path / "elsewhere-credentials"
    creds.write_text("[default]\naws_access_key_id = ELSEWHERE\naws_secret_access_key = X\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    assert profile_config({})["aws_access_key_id"] == "ELSEWHERE"
    bad = tmp_path / "bad-config"
    bad.write_text("no section header\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(bad))
    with pytest.raises(OptionError, match="bad-config: not a readable AWS configuration file"):
        profile_config({})
