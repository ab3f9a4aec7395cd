"""The producer helpers on the real brokers: the key they stamp is the key the consumers derive,
and a key already done is not published (RabbitMQ through kombu, Kafka through tansu)."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import redis
from confluent_kafka import Producer
from kombu import Connection
from kombu import Producer as KombuProducer
from kombu.exceptions import OperationalError
from prometheus_client import CollectorRegistry

from dedupe_worker import Deduplicator, State
from dedupe_worker._messages.envelope import from_kafka, from_kombu
from dedupe_worker.keys import KAFKA_DEFAULT, RABBITMQ_DEFAULT
from dedupe_worker.observe import current
from dedupe_worker.observe._metrics import MetricsObserver
from dedupe_worker.producers import Sent, produce_once, publish_once, send_actor_once, stamp

from .kafka_fixtures import Topics, kafka_topics, read_topic
from .rabbitmq_fixtures import amqp, depth, queue_name, wait_for
from .recording import record

__all__ = ["amqp", "kafka_topics", "queue_name", "record"]


def test_kombu_helper_stamps_the_consumers_key_and_skips_work_done(
        amqp: Connection, queue_name: str, dedupe: Deduplicator) -> None:
    producer = KombuProducer(amqp.default_channel)
    sent = publish_once(producer, {"order": 42}, key="charge:42", deduplicator=dedupe, exchange="",
                        routing_key=queue_name, serializer="json", headers={"trace": "t1"})
    assert sent == Sent(True)
    wait_for(lambda: depth(amqp, queue_name) == 1, what="the message in the queue")
    message = amqp.default_channel.basic_get(queue=queue_name, no_ack=True)
    assert message.headers == {"trace": "t1", "idempotency-key": "charge:42"}
    assert RABBITMQ_DEFAULT(from_kombu(message, queue_name)) == "charge:42"

    dedupe.run("charge:42", lambda: {"charged": 42})
    again = publish_once(producer, {"order": 42}, key="charge:42", deduplicator=dedupe, exchange="",
                         routing_key=queue_name, serializer="json")
    assert not again.published and again.state is not None and again.state.state is State.DONE
    publish_once(producer, b"marker", key="other", exchange="", routing_key=queue_name)
    wait_for(lambda: depth(amqp, queue_name) == 1, what="the marker in the queue")  # only it
    assert amqp.default_channel.basic_get(queue=queue_name, no_ack=True).body == b"marker"


def test_kombu_helper_publishes_while_redis_is_down(amqp: Connection, queue_name: str,
                                                    private_redis: Any) -> None:
    dedupe = Deduplicator(redis.Redis.from_url(private_redis.url), namespace="down")
    private_redis.stop()
    sent = publish_once(KombuProducer(amqp.default_channel), b"x", key="k1", deduplicator=dedupe, exchange="",
                        routing_key=queue_name)
    assert sent == Sent(True)
    wait_for(lambda: depth(amqp, queue_name) == 1, what="the message in the queue")


def test_kombu_helper_a_publish_that_raises_leaves_nothing_and_its_retry_publishes_once(
        amqp: Connection, queue_name: str, dedupe: Deduplicator) -> None:
    registry = CollectorRegistry()
    observer = current.enable(MetricsObserver(registry))
    try:
        with socket.socket() as s:  # a port nothing listens on: the broker is down
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with Connection(f"amqp://guest:guest@127.0.0.1:{port}//", connect_timeout=0.5,
                        transport_options={"max_retries": 0}) as down, pytest.raises(OperationalError):
            publish_once(KombuProducer(down), b"x", key="k2", deduplicator=dedupe, exchange="",
                         routing_key=queue_name, retry=False)
        sent = publish_once(KombuProducer(amqp.default_channel), b"x", key="k2", deduplicator=dedupe,
                            exchange="", routing_key=queue_name)  # the caller's retry, the broker back
    finally:
        current.disable(observer)
    assert sent == Sent(True)
    wait_for(lambda: depth(amqp, queue_name) == 1, what="the message in the queue")
    assert registry.get_sample_value("dedupe_sends_total", {"integration": "kombu", "outcome": "published"}) == 1


def test_kafka_helper_stamps_the_consumers_key_and_skips_work_done(
        kafka_topics: Topics, kafka_bootstrap: str, dedupe: Deduplicator) -> None:
    topic = kafka_topics.create()
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 0})
    first = produce_once(producer, topic, b'{"order": 7}', key="charge:7", deduplicator=dedupe,
                         partition_key=b"customer-1", headers={"trace": b"t7"})
    producer.flush(10)
    dedupe.run("charge:7", lambda: "done")
    second = produce_once(producer, topic, b'{"order": 7}', key="charge:7", deduplicator=dedupe)
    producer.flush(10)

    assert first.published and not second.published
    assert second.state is not None and second.state.state is State.DONE
    records = read_topic(kafka_bootstrap, topic, expected=2, idle=2.0)
    assert len(records) == 1
    assert records[0].key() == b"customer-1"
    assert dict(records[0].headers() or []) == {"trace": b"t7", "idempotency-key": b"charge:7"}
    assert KAFKA_DEFAULT(from_kafka(records[0])) == "charge:7"


def test_stamp_adds_the_header_the_consumers_read() -> None:
    assert stamp("k", {"a": 1}) == {"a": 1, "idempotency-key": "k"}
    assert stamp("k", header="x-key") == {"x-key": "k"}


def test_dramatiq_helper_uses_the_middlewares_key_and_skips_work_done(
        rabbitmq_url: str, dedupe: Deduplicator, record: str) -> None:
    import uuid

    import pika

    from . import dramatiq_app

    queue = f"dq-test-{uuid.uuid4().hex[:10]}"
    app = dramatiq_app.build(rabbitmq_url, dedupe, queue, record)
    apply = app.actors["apply"]
    try:
        assert send_actor_once(apply, 3, 30, deduplicator=dedupe) == Sent(True)
        worker = dramatiq_app.dramatiq.Worker(app.broker, worker_threads=1, worker_timeout=100)
        worker.start()
        try:
            wait_for(lambda: app.middleware.count("applied") == 1, what="the actor to run")
        finally:
            worker.stop()
        again = send_actor_once(apply, 3, 30, deduplicator=dedupe)
        assert not again.published and again.state is not None and again.state.state is State.DONE
        assert dedupe.status("order:3").state is State.DONE  # the key the middleware claimed
        connection = pika.BlockingConnection(pika.URLParameters(dramatiq_app.pika_url(rabbitmq_url)))
        try:
            assert connection.channel().queue_declare(queue, passive=True).method.message_count == 0
        finally:
            connection.close()
    finally:
        app.broker.close()
        connection = pika.BlockingConnection(pika.URLParameters(dramatiq_app.pika_url(rabbitmq_url)))
        for name in (queue, f"{queue}.DQ", f"{queue}.XQ"):
            connection.channel().queue_delete(queue=name)
        connection.close()


def test_exported_names() -> None:
    import dedupe_worker._protocol.sending
    import dedupe_worker._transport.sending
    import dedupe_worker.celery._send
    import dedupe_worker.producers

    assert dedupe_worker.producers.__all__ == ["DEFAULT_HEADER", "Sent", "broker_publish_once", "produce_once",
                                               "publish_once", "send_actor_once", "stamp"]
    assert dedupe_worker.celery._send.__all__ == ["EXPECTED_QUEUE_TIME", "send_once", "send_ttl",
                                                 "sends_deduplicated"]
    # the send check's call and answer are the state machine's, its round trips the transport's
    assert dedupe_worker._protocol.sending.__all__ == ["SendAnswer", "SendState", "send_answer", "send_call"]
    assert dedupe_worker._transport.sending.__all__ == ["check_send", "unsend"]
