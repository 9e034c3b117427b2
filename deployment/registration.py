"""Registering a ``pyflyte package`` tarball (``make package``) with FlyteAdmin through ``FlyteRemote``.

Contract:

- In: the tarball pyflyte writes, one protobuf per entity (``<order>_<name>_1.pb`` a TaskSpec, ``_2.pb`` a
  WorkflowSpec, ``_3.pb`` a LaunchPlan) and, for a fast-registered package (``--copy all``), the code as
  ``fast*.tar.gz``. Anything else is refused with ``ValueError`` before FlyteAdmin is contacted.
- Out: every entity registered in one project and domain under one version, in the package's order (whatever an
  entity references comes before it). The project, domain and version that pyflyte leaves blank in every
  identifier, an entity's own and those it references, are filled in as ``flytectl register files`` does; a
  fast-registered package's code is uploaded first and its tasks point at the upload.
- The default version is a digest of the entities (:func:`default_version`), so registering an unchanged package
  again changes nothing; entities that already exist with that version are left as they are.
- :func:`read_package`, :func:`hydrate` and :func:`default_version` touch no network; only
  :func:`register_package` talks to FlyteAdmin (and the object store, for the code). Nothing is printed: progress
  goes to the ``report`` callback. The command line is ``python -m deployment.remote register``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

from flytekit.configuration import ImageConfig, SerializationSettings
from flytekit.models.core.identifier import Identifier
from flytekit.remote import FlyteRemote
from google.protobuf.message import Message

# What `pyflyte package --copy all` leaves in task arguments for the registrar to replace with the uploaded code.
REMOTE_PACKAGE_PATH = "{{ .remote_package_path }}"


@dataclasses.dataclass
class Package:
    """A ``pyflyte package`` tarball, decoded."""

    path: Path
    entities: list[Message]
    """flyteidl ``admin.TaskSpec``, ``admin.WorkflowSpec`` and ``admin.LaunchPlan`` messages, in the order pyflyte
    wrote them: everything after what it references."""
    fast_archive: str | None
    """The member holding the code of a fast-registered package (``--copy all``), None when the image holds it."""

    @property
    def digest(self) -> str:
        """sha256 over the entities (deterministic serialization): equal for equal packages, whenever built."""
        sha = hashlib.sha256()
        for entity in self.entities:
            sha.update(entity.SerializeToString(deterministic=True))
        return sha.hexdigest()


def read_package(path: str | os.PathLike[str]) -> Package:
    """Decode every entity of the tarball; the file suffix is the resource type (``_1`` task, ``_2`` workflow,
    ``_3`` launch plan, as in flyteidl's ResourceType).

    :raises ValueError: when the file is not such a tarball.
    """
    from flyteidl.admin import launch_plan_pb2, task_pb2, workflow_pb2

    decoders = {"_1.pb": task_pb2.TaskSpec, "_2.pb": workflow_pb2.WorkflowSpec, "_3.pb": launch_plan_pb2.LaunchPlan}
    path = Path(path)
    if not tarfile.is_tarfile(path):
        raise ValueError(f"package={str(path)!r} is invalid: not a tarball; build it with `make package`")
    entities: list[tuple[int, Message]] = []
    fast_archive = None
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            base = os.path.basename(member.name)
            decoder = next((d for suffix, d in decoders.items() if base.endswith(suffix)), None)
            if decoder is not None:
                order = int(base.split("_", 1)[0])
                entities.append((order, decoder.FromString(tar.extractfile(member).read())))
            elif base.startswith("fast") and base.endswith(".tar.gz"):
                fast_archive = member.name
            else:
                raise ValueError(
                    f"package={str(path)!r} is invalid: unexpected member {member.name!r}; build it with `make package`"
                )
    if not entities:
        raise ValueError(f"package={str(path)!r} is invalid: it holds no entities; build it with `make package`")
    return Package(
        path=path, entities=[e for _, e in sorted(entities, key=lambda pair: pair[0])], fast_archive=fast_archive
    )


def _fill_identifiers(message: Message, values: Mapping[str, str]) -> None:
    """Set every blank project/domain/version of every ``core.Identifier`` inside ``message``."""
    if message.DESCRIPTOR.full_name == "flyteidl.core.Identifier":
        for field, value in values.items():
            if not getattr(message, field):
                setattr(message, field, value)
        return
    for field, value in message.ListFields():
        if field.message_type is None or field.message_type.full_name.startswith("google.protobuf."):
            continue
        if field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            if value_field.message_type is not None:
                for item in value.values():
                    _fill_identifiers(item, values)
        elif field.is_repeated:
            for item in value:
                _fill_identifiers(item, values)
        else:
            _fill_identifiers(value, values)


def hydrate(package: Package, *, project: str, domain: str, version: str, code_uri: str | None = None) -> list[Any]:
    """The package's entities as FlyteAdmin is to store them (flytekit models for ``FlyteRemote.raw_register``).

    pyflyte leaves project, domain and version blank in every identifier, the entities' own and those they
    reference; they are filled in here, as ``flytectl register files`` does. In a fast-registered package the
    tasks' code location becomes ``code_uri``.

    :raises ValueError: for a fast-registered package without ``code_uri``.
    """
    from flyteidl.admin import launch_plan_pb2, task_pb2
    from flytekit.models import launch_plan as launch_plan_models
    from flytekit.models import task as task_models
    from flytekit.models.admin import workflow as workflow_models

    if package.fast_archive is not None and not code_uri:
        raise ValueError(
            f"package={str(package.path)!r} is fast-registered: upload {package.fast_archive} and pass its URI as "
            "code_uri"
        )
    models = []
    for original in package.entities:
        message = type(original)()
        message.CopyFrom(original)
        _fill_identifiers(message, {"project": project, "domain": domain, "version": version})
        if isinstance(message, task_pb2.TaskSpec):
            if code_uri:
                args = [code_uri if arg == REMOTE_PACKAGE_PATH else arg for arg in message.template.container.args]
                message.template.container.ClearField("args")
                message.template.container.args.extend(args)
            models.append(task_models.TaskSpec.from_flyte_idl(message))
        elif isinstance(message, launch_plan_pb2.LaunchPlan):
            models.append(launch_plan_models.LaunchPlan.from_flyte_idl(message))
        else:
            models.append(workflow_models.WorkflowSpec.from_flyte_idl(message))
    return models


def default_version(package: Package) -> str:
    """A version named after the package's content: re-registering the same package changes nothing."""
    return f"pkg-{package.digest[:16]}"


def register_package(
    remote: FlyteRemote,
    path: str | os.PathLike[str],
    *,
    project: str,
    domain: str,
    version: str | None,
    report: Callable[[str], None],
) -> list[Identifier]:
    """Register every entity of a ``make package`` tarball in ``project``/``domain`` under ``version``
    (default: :func:`default_version`); a fast-registered package's code is uploaded first. Entities that already
    exist with that version are left as they are."""
    package = read_package(path)
    version = version or default_version(package)
    code_uri = None
    if package.fast_archive is not None:
        with tempfile.TemporaryDirectory() as tmp, tarfile.open(package.path) as tar:
            tar.extract(package.fast_archive, tmp, filter="data")
            _, code_uri = remote.upload_file(Path(tmp, package.fast_archive), project=project, domain=domain)
        report(f"uploaded the code to {code_uri}")
    entities = hydrate(package, project=project, domain=domain, version=version, code_uri=code_uri)
    # raw_register reads only project, domain and version from the settings; the images are in the entities.
    settings = SerializationSettings(
        image_config=ImageConfig.auto_default_image(), project=project, domain=domain, version=version
    )
    registered = []
    for entity in entities:
        identifier = remote.raw_register(entity, settings, version, create_default_launchplan=False)
        report(
            f"{identifier.resource_type_name().lower()} {identifier.name} {identifier.version}: "
            f"{remote.generate_console_url(identifier)}"
        )
        registered.append(identifier)
    report(f"registered {len(registered)} entities in {project}/{domain} as version {version}")
    return registered
