"""AWS named profiles (``~/.aws/credentials`` and ``~/.aws/config``) as the store's S3 configuration, the way the AWS
CLI and boto3 read them, since obstore reads only the environment and instance roles.

The profile is ``storage_options["profile"]``, else ``$AWS_PROFILE``, else ``$AWS_DEFAULT_PROFILE``, else
``default``; the files are ``$AWS_SHARED_CREDENTIALS_FILE`` and ``$AWS_CONFIG_FILE`` or their usual places. Static
keys, session token, region and ``endpoint_url`` are taken; a profile that gets its credentials by running
something (``credential_process``), assuming a role or SSO is refused with what to do instead: packer never runs a
command found in a file. What ``storage_options`` or the ``AWS_*`` environment give explicitly wins over the files.
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Mapping
from pathlib import Path

from packer.errors import OptionError

# profile key -> obstore config key
_KEYS = {"aws_access_key_id": "aws_access_key_id", "aws_secret_access_key": "aws_secret_access_key",
         "aws_session_token": "aws_session_token", "region": "region", "endpoint_url": "endpoint"}
_CREDENTIALS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
_RUNS_SOMETHING = ("credential_process", "role_arn", "sso_session", "sso_start_url", "web_identity_token_file")
_ENVIRONMENT = {"aws_access_key_id": "AWS_ACCESS_KEY_ID", "region": "AWS_REGION", "endpoint": "AWS_ENDPOINT_URL"}


def _read(path: Path) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(interpolation=None)
    try:
        parser.read(path, encoding="utf-8")
    except (configparser.Error, UnicodeDecodeError) as exc:
        raise OptionError(f"{path}: not a readable AWS configuration file ({type(exc).__name__})") from None
    return parser


def _files(environ: Mapping[str, str]) -> tuple[Path, Path]:
    home = Path(environ.get("HOME") or os.path.expanduser("~"))
    return (Path(environ.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials"),
            Path(environ.get("AWS_CONFIG_FILE") or home / ".aws" / "config"))


def profile_config(options: Mapping[str, object], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The obstore S3 configuration a named profile adds to ``options`` (without ``profile`` itself); empty where no
    profile file exists. An explicitly named profile that no file holds is an OptionError naming it."""
    environ = os.environ if environ is None else environ
    named = options.get("profile")
    name = str(named or environ.get("AWS_PROFILE") or environ.get("AWS_DEFAULT_PROFILE") or "default")
    credentials_file, config_file = _files(environ)
    found: dict[str, str] = {}
    seen = False
    for path, section in ((config_file, "default" if name == "default" else f"profile {name}"),
                          (credentials_file, name)):
        if not path.is_file():
            continue
        parser = _read(path)
        if parser.has_section(section):
            seen = True
            found.update({k: v.strip() for k, v in parser.items(section) if v.strip()})
    if not seen:
        if named or environ.get("AWS_PROFILE"):
            raise OptionError(f"AWS profile {name!r} is in neither {credentials_file} nor {config_file}")
        return {}
    explicit_credentials = any(k in options for k in _CREDENTIALS) or (
        not named and _ENVIRONMENT["aws_access_key_id"] in environ)
    out: dict[str, str] = {}
    for key, target in _KEYS.items():
        if key not in found or target in options or (key in _CREDENTIALS and explicit_credentials):
            continue
        variable = _ENVIRONMENT.get(target)
        if not named and variable is not None and variable in environ:
            continue  # AWS_REGION / AWS_ENDPOINT_URL set: obstore takes them, as the AWS CLI would
        out[target] = found[key]
    if "aws_access_key_id" not in out and not explicit_credentials:
        runs = [k for k in _RUNS_SOMETHING if k in found]
        if runs:
            raise OptionError(
                f"AWS profile {name!r} gets its credentials through {', '.join(runs)}, which packer does not run: "
                f"export them first (eval \"$(aws configure export-credentials --profile {name} --format env)\") "
                "or pass aws_access_key_id/aws_secret_access_key in storage_options")
    return out
