"""No Docker engine here: check that the compose file parses and names what the README says."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_compose_file_names_the_services_the_readme_mentions() -> None:
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    assert {"redis", "rabbitmq", "kafka", "worker"} <= set(services)
    assert services["worker"]["build"]["dockerfile"] == "docker/Dockerfile"
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft
    readme = (ROOT / "README.md").read_text()
    for name in ("redis", "rabbitmq", "kafka", "worker"):
        assert f"`{name}`" in readme, name
    assert (ROOT / "docker" / "Dockerfile").read_text().count("COPY lua") == 1
