"""The fault-injection soak: ``python -m tests.soak --duration SECONDS --seed N --integrations ...``.

It runs the library's real integrations together (a Celery ``IdempotentTask`` on a prefork
worker, two ``DedupeConsumer`` processes on one RabbitMQ queue, two ``DedupeKafkaConsumer``
processes in one group on a 3-partition topic, ``dedupe-worker replay`` draining a dead-letter
queue), sends every operation at least twice, injects real faults (SIGKILL, SIGSTOP past the
lease, Redis restarts and outages, broker connection cuts, Kafka rebalances), drains, and
prints one table per integration from a PostgreSQL ledger. It fails on any lost operation and
any operation applied twice. Modules: ``traffic`` (producer), ``ledger``, ``proxy``, ``faults``,
``processes``, ``report``, ``harness`` (:func:`run_soak`), ``handlers`` / ``workers`` /
``celery_app`` (what the worker processes run).
"""
