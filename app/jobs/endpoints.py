"""HTTP routes of the jobs API. Routers hold no SQL and no rules: they call the service."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request, Response, status
from fastapi.responses import StreamingResponse

from app.deps import SessionDep, SettingsDep
from app.jobs import schemas
from app.jobs.document_cache import DocumentCache, wants_fresh
from app.jobs.documents import JobDocuments, render_document
from app.jobs.service import JobService
from hsx.errors import UnsupportedMediaType
from hsx.server.regenerate.export import MEDIA_TYPE
from hsx.server.settings import Settings

router = APIRouter(prefix="/jobs", tags=["jobs"])

ERRORS: dict[int | str, dict[str, object]] = {
    400: {"model": schemas.ErrorOut},
    401: {"model": schemas.ErrorOut},
    403: {"model": schemas.ErrorOut},
    404: {"model": schemas.ErrorOut},
    409: {"model": schemas.ErrorOut},
    413: {"model": schemas.ErrorOut},
    415: {"model": schemas.ErrorOut},
    422: {"model": schemas.ErrorOut},
    500: {"model": schemas.ErrorOut},
}


def json_body(request: Request) -> None:
    """Refuse a body sent as something other than JSON (curl -d sends a form) with a reason that says so."""
    # FastAPI leaves a body without a declared JSON type unread, which would surface as "field required".
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise UnsupportedMediaType(
        f"the body must be JSON, sent with Content-Type: application/json (got {media or 'an empty type'}); "
        "with curl: -H 'Content-Type: application/json'",
        error="unsupported_media_type",
    )


@router.post(
    "",
    response_model=schemas.JobOut,
    status_code=status.HTTP_201_CREATED,
    dependencies=[Depends(json_body)],
    responses={
        **ERRORS,
        200: {"model": schemas.JobOut, "description": "The job an earlier request with this key created"},
    },
)
def submit_job(
    body: schemas.JobCreate,
    response: Response,
    session: SessionDep,
    settings: SettingsDep,
    idempotency_key: Annotated[str | None, Header(max_length=200, pattern=r"^[A-Za-z0-9._:\-]+$")] = None,
) -> schemas.JobOut:
    job, created = JobService(session, settings).submit(body, idempotency_key)
    if not created:
        response.status_code = status.HTTP_200_OK
    response.headers["Location"] = f"/jobs/{job.id}"
    return JobDocuments(session, settings).document(job)


@router.get("", response_model=schemas.JobPage, responses=ERRORS)
def list_jobs(
    session: SessionDep,
    settings: SettingsDep,
    state: schemas.JobStateName | None = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    offset: Annotated[int, Query(ge=0, le=1_000_000_000)] = 0,
) -> schemas.JobPage:
    return JobDocuments(session, settings).jobs(state, limit, offset)


_documents: DocumentCache | None = None


def document_cache(settings: Settings) -> DocumentCache:
    global _documents
    if _documents is None or _documents.ttl != settings.job_document_ttl_seconds:
        _documents = DocumentCache(settings.job_document_ttl_seconds)
    return _documents


@router.get("/{job_id}", response_model=schemas.JobOut, responses=ERRORS)
async def get_job(
    job_id: str,
    settings: SettingsDep,
    cache_control: Annotated[
        str | None,
        Header(
            description="no-cache: read the job table now. Without it a poll may get a rendering up to "
            "HSX_JOB_DOCUMENT_TTL_SECONDS old (20 times that while a new one is made)."
        ),
    ] = None,
) -> Response:
    """A job's document. Polls share a short-lived rendering; a single look whose answer must be current
    (``hsx status``) sends ``Cache-Control: no-cache``."""
    # Async, with no session of its own: a poll the cache answers never leaves the event loop.
    documents = document_cache(settings)

    def render() -> bytes:
        return render_document(settings, job_id)

    fresh = wants_fresh(cache_control)
    body = await (documents.fresh(job_id, render) if fresh else documents.fetch(job_id, render))
    # Already rendered through JobOut: sent as it is rather than validated and serialised again.
    return Response(content=body, media_type="application/json")


@router.get("/{job_id}/shards", response_model=schemas.ShardPage, responses=ERRORS)
def get_shards(
    job_id: str,
    session: SessionDep,
    settings: SettingsDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=1_000_000_000)] = 0,
) -> schemas.ShardPage:
    return JobDocuments(session, settings).shards(job_id, limit, offset)


@router.get("/{job_id}/rejections", response_model=schemas.RejectionPage, responses=ERRORS)
def get_rejections(
    job_id: str,
    session: SessionDep,
    settings: SettingsDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=1_000_000_000)] = 0,
) -> schemas.RejectionPage:
    return JobDocuments(session, settings).rejections(job_id, limit, offset)


@router.get("/{job_id}/truncations", response_model=schemas.TruncationPage, responses=ERRORS)
def get_truncations(
    job_id: str,
    session: SessionDep,
    settings: SettingsDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=1_000_000_000)] = 0,
) -> schemas.TruncationPage:
    return JobDocuments(session, settings).truncations(job_id, limit, offset)


@router.get(
    "/{job_id}/regenerated",
    response_class=StreamingResponse,
    responses={**ERRORS, 200: {"content": {MEDIA_TYPE: {}}, "description": "One kept sample a line"}},
)
def get_regenerated(job_id: str, settings: SettingsDep) -> StreamingResponse:
    """A regenerate job's regenerated dataset, as JSONL in the messages form POST /jobs accepts (with each
    sample's id, token ids, loss mask and generation parameters); what is kept so far while it runs."""
    from hsx.server.db.session import session_factory

    session = session_factory(settings.resolved_database_url)()
    try:
        lines = JobDocuments(session, settings).regenerated_lines(job_id)
    except BaseException:
        session.close()
        raise

    def body() -> Iterator[bytes]:
        # The stream outlives the request's dependencies, so it holds a session of its own.
        try:
            yield from lines
        finally:
            session.close()

    return StreamingResponse(body(), media_type=MEDIA_TYPE)


@router.post("/{job_id}/retry", response_model=schemas.JobOut, responses=ERRORS)
def retry_job(job_id: str, session: SessionDep, settings: SettingsDep) -> schemas.JobOut:
    """Run a failed, cancelled or finished job again: its failed units, and its samples rejected for an
    engine-side reason (cached_tokens, dump_missing, engine_timeout, ...). Published samples stay."""
    job = JobService(session, settings).retry(job_id)
    document = JobDocuments(session, settings).document(job)
    document_cache(settings).forget(job_id)
    return document


@router.post("/{job_id}/cancel", response_model=schemas.JobOut, responses=ERRORS)
def cancel_job(job_id: str, session: SessionDep, settings: SettingsDep) -> schemas.JobOut:
    job = JobService(session, settings).cancel(job_id)
    document = JobDocuments(session, settings).document(job)
    document_cache(settings).forget(job_id)
    return document
