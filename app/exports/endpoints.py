"""HTTP routes of the exports API: a succeeded job's output written in a trainer's layout, as an RQ job.
Routers hold no rules: they call the service."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response, status

from app.deps import SessionDep, SettingsDep
from app.exports import schemas
from app.exports.service import ExportService, document
from app.jobs.endpoints import ERRORS, json_body
from app.jobs.schemas import ErrorOut

router = APIRouter(prefix="/jobs", tags=["exports"])


@router.post(
    "/{job_id}/exports",
    response_model=schemas.ExportOut,
    status_code=status.HTTP_202_ACCEPTED,
    dependencies=[Depends(json_body)],
    responses={
        **ERRORS,
        200: {"model": schemas.ExportOut, "description": "The same export, queued or made earlier"},
        503: {"model": ErrorOut, "description": "The queue is unavailable"},
    },
)
def create_export(
    job_id: str, body: schemas.ExportCreate, response: Response, session: SessionDep, settings: SettingsDep
) -> schemas.ExportOut:
    export, created = ExportService(session, settings).create(job_id, body)
    if not created:
        response.status_code = status.HTTP_200_OK
    return document(export)


@router.get("/{job_id}/exports", response_model=schemas.ExportPage, responses=ERRORS)
def list_exports(job_id: str, session: SessionDep, settings: SettingsDep) -> schemas.ExportPage:
    items = [document(s) for s in ExportService(session, settings).list(job_id)]
    return schemas.ExportPage(items=items, total=len(items))


@router.get("/{job_id}/exports/{export_id}", response_model=schemas.ExportOut, responses=ERRORS)
def get_export(job_id: str, export_id: str, session: SessionDep, settings: SettingsDep) -> schemas.ExportOut:
    return document(ExportService(session, settings).get(job_id, export_id))
