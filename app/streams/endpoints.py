"""HTTP routes of a job's stream. Routers hold no SQL and no rules: they call hsx.server.streams.service."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response, status
from fastapi.concurrency import run_in_threadpool

from app.deps import SessionDep, SettingsDep
from app.jobs.endpoints import ERRORS, document_cache, json_body
from app.streams import schemas
from hsx.server.streams import news
from hsx.server.streams.service import LeaseAnswer, StreamService
from hsx.server.streams.views import consumer_view

router = APIRouter(prefix="/jobs/{job_id}/consumers", tags=["streams"])


@router.post(
    "",
    response_model=schemas.ConsumerOut,
    status_code=status.HTTP_201_CREATED,
    dependencies=[Depends(json_body)],
    responses=ERRORS,
)
def register_consumer(
    job_id: str, body: schemas.ConsumerCreate, response: Response, session: SessionDep, settings: SettingsDep
) -> schemas.ConsumerOut:
    consumer = StreamService(session, settings).register(job_id, body.name, body.lease_seconds, body.group)
    response.headers["Location"] = f"/jobs/{job_id}/consumers/{consumer.id}"
    document_cache(settings).forget(job_id)
    # A new consumer holds nothing, and was heard from just now.
    return schemas.ConsumerOut.model_validate(consumer_view(consumer, (0, 0), consumer.last_seen))


@router.get("", response_model=schemas.ConsumerPage, responses=ERRORS)
def list_consumers(job_id: str, session: SessionDep, settings: SettingsDep) -> schemas.ConsumerPage:
    consumers = StreamService(session, settings).consumers(job_id)
    return schemas.ConsumerPage(items=[schemas.ConsumerOut.model_validate(c) for c in consumers])


@router.post(
    "/{consumer_id}/leases",
    response_model=schemas.LeaseOut,
    dependencies=[Depends(json_body)],
    responses=ERRORS,
)
async def lease(
    job_id: str, consumer_id: str, body: schemas.LeaseRequest, session: SessionDep, settings: SettingsDep
) -> schemas.LeaseOut:
    seen = None if body.seen is None else [(d.id, d.delivery) for d in body.seen]
    service = StreamService(session, settings)

    async def look() -> LeaseAnswer:
        return await run_in_threadpool(service.lease, job_id, consumer_id, body.max_items, seen)

    # Async so that a waiting lease holds no thread of the pool (and no database connection) while it waits.
    answer = (
        await news.wait_for(settings, job_id, body.wait_seconds, look, LeaseAnswer.worth_waiting)
        if body.wait_seconds > 0
        else await look()
    )
    return schemas.LeaseOut.model_validate(answer)


@router.post(
    "/{consumer_id}/acks", response_model=schemas.AckOut, dependencies=[Depends(json_body)], responses=ERRORS
)
def acknowledge(
    job_id: str, consumer_id: str, body: schemas.AckRequest, session: SessionDep, settings: SettingsDep
) -> schemas.AckOut:
    answer = StreamService(session, settings).ack(
        job_id, consumer_id, [(d.id, d.delivery) for d in body.items]
    )
    document_cache(settings).forget(job_id)
    return schemas.AckOut.model_validate(answer)


@router.delete("/{consumer_id}", status_code=status.HTTP_204_NO_CONTENT, responses=ERRORS)
def close_consumer(job_id: str, consumer_id: str, session: SessionDep, settings: SettingsDep) -> Response:
    """The consumer leaves: the items it holds go back to the others at once."""
    StreamService(session, settings).close(job_id, consumer_id)
    document_cache(settings).forget(job_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
