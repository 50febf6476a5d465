"""`/v1/files`: upload, list, get, download and delete a tenant's files (purpose ``batch``).

An upload is received into a temporary file under ``<data_dir>/files`` and then
stored in the database, row and content in one transaction, so a cut upload
leaves neither a row nor a partial file, and every gateway sharing the database
serves every file. Files written before contents moved into the database are
still read from the data directory.

An upload is a request like any other for the tenant's request rate and concurrency (admitted before its body
is read: a 429 with ``Retry-After`` past them), and the tenant's stored files may take at most its quota's
``max_stored_file_bytes`` together: an upload past it is a 413 ``storage_limit_exceeded``, refused as soon as
its bytes pass the room left, and checked again in the transaction that stores it.

Files are kept until deleted. The expiry policy OpenAI's API takes for a file (``expires_after`` on upload,
``output_expires_after`` for a batch's output and error files: ``{"anchor": "created_at", "seconds": N}``, N from
3600 to 2592000) is checked (``file_expiry``) and accepted, since the openai client sends it, but not applied:
a file object's ``expires_at`` stays null; delete files when done (``DELETE /v1/files/{file_id}``).
"""

import asyncio
import os
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.multipart import BodyPartReader, MultipartReader, parse_content_disposition

from gateway.admission import QUOTAS
from gateway.auth import PRINCIPAL
from gateway.errors import BODY_TIMEOUT_S, APIError, stalled_body, unreadable_body
from gateway.json_types import decode_typed
from gateway.openai_schema import error_param
from gateway.plain_admission import admitted
from gateway.replies import json_response, query_limit
from tenants.batch_store import BatchStore, FileInfo, StorageFull
from tenants.models import MAX_FILENAME_CHARS

BATCH_STORE = web.AppKey("batch_store", BatchStore)
DATA_DIR = web.AppKey("data_dir", Path)
MAX_FILE_BYTES = web.AppKey("max_file_bytes", int)
UPLOAD_PURPOSES = ("batch",)
_CHUNK = 1 << 16
# OpenAI's bounds on a file's expiry: one hour to 30 days after the file is created.
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 2592000
# The multipart fields the openai client sends an upload's expires_after as -> the policy's fields.
EXPIRY_PARTS = {"expires_after[anchor]": "anchor", "expires_after[seconds]": "seconds"}
# Every field an upload takes: what the openai client's files.create sends. Any other is a 400 naming it.
UPLOAD_FIELDS = ("file", "purpose", *EXPIRY_PARTS)


class FileExpiry(msgspec.Struct, forbid_unknown_fields=True):
    """A file's expiry policy as OpenAI's API takes it (documented in the OpenAPI document; see ``file_expiry``)."""

    anchor: Literal["created_at"]
    seconds: Annotated[int, msgspec.Meta(ge=MIN_EXPIRY_S, le=MAX_EXPIRY_S)]


def file_expiry(raw: Any, field: str, form: bool = False) -> FileExpiry | None:
    """``raw`` (the JSON value of ``field``, or with ``form`` the text values of its multipart fields) as an
    expiry policy; None for null. A JSON value has its field's JSON type, a whole-number float such as ``3600.0``
    taken for the integer as in every JSON body (``decode_typed``); form text is read as the number it writes.
    Anything else is a 400 naming the part of ``field`` at fault."""
    if raw is None:
        return None
    try:
        if form:
            return msgspec.convert(raw, FileExpiry, strict=False)
        return decode_typed(msgspec.json.encode(raw), FileExpiry)
    except msgspec.ValidationError as e:
        part, why = error_param(e), str(e)
    hint = {"anchor": "anchor must be 'created_at' (the file's creation time)",
            "seconds": f"seconds must be a whole number from {MIN_EXPIRY_S} (1 hour) to {MAX_EXPIRY_S} (30 days)"}
    where = f"{field}.{part}" if part else field
    raise APIError(400, f"{where} is invalid ({why}); give {field} as {{\"anchor\": \"created_at\", \"seconds\": N}}: "
                        f"{hint.get(part, 'an object of these two fields only')}", param=where)


def file_object(f: FileInfo) -> dict:
    return {"id": f.id, "object": "file", "bytes": f.bytes, "created_at": int(f.created_at.timestamp()),
            "filename": f.filename, "purpose": f.purpose, "status": "processed", "status_details": None,
            "expires_at": None}


def file_path(data_dir: Path, rel: str) -> Path:
    return data_dir / rel


def _not_found(file_id: str) -> APIError:
    return APIError(404, f"no such file: {file_id!r}", "invalid_request_error", param="file_id", code="file_not_found")


def _malformed_multipart(err: Exception) -> APIError:
    # The parser's message quotes the bytes it choked on; the client has them already.
    return APIError(400, f"the multipart/form-data body is malformed ({type(err).__name__}); send the fields "
                    "'file' and 'purpose' as a standard multipart upload", param="file")


def _utf8_filename(name: str) -> str:
    """The part's file name; aiohttp keeps bytes that are not UTF-8 as surrogates, which cannot be stored, and
    the database keeps at most ``MAX_FILENAME_CHARS`` characters of it."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "the uploaded file's name is not UTF-8 text; rename the file", param="file") from None
    if len(name) > MAX_FILENAME_CHARS:
        raise APIError(400, f"the uploaded file's name has {len(name):,} characters; at most {MAX_FILENAME_CHARS} are "
                            "kept: rename the file", param="file")
    return name


def _form_text(raw: bytes, name: str) -> str:
    """A multipart text field's value; 400 naming ``name`` if it is not UTF-8."""
    try:
        return raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise APIError(400, f"{name} must be UTF-8 text", param=name) from None


async def _read_field(part: BodyPartReader, name: str, progress, limit: int) -> str:
    """A text field's value (read through the upload's ``progress`` guard); a 413 naming ``name`` when it is
    longer than ``limit``, the request limit aiohttp holds a field read whole to; 400 if it is not UTF-8."""
    try:
        raw = await progress(part.read(decode=True))
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, f"the form field {name} is longer than this server's limit of {limit} "
                            "bytes for one field; send its short value (only the file may be large)", param=name,
                       code="request_too_large") from None
    return _form_text(raw, name)


def _check_form_field(part: BodyPartReader | MultipartReader, seen: set[str]) -> None:
    """400 for a multipart part an upload does not take: a multipart body of its own (``multipart/mixed``),
    one without a name, a field other than ``UPLOAD_FIELDS``, or one given again (``seen``: the fields so far, to
    which the part's name is added)."""
    if not isinstance(part, BodyPartReader):  # a nested multipart body has no field name of its own to read
        name = parse_content_disposition(part.headers.get(hdrs.CONTENT_DISPOSITION))[1].get("name")
        raise APIError(400, f"the field {name!r} is a multipart body of its own (multipart/mixed); send each field "
                            f"as one part: {', '.join(UPLOAD_FIELDS)}", param=name)
    name = part.name
    if name is None:
        raise APIError(400, "a part of the multipart body has no field name; send only the fields "
                            f"{', '.join(UPLOAD_FIELDS)}")
    if name not in UPLOAD_FIELDS:
        raise APIError(400, f"{name!r} is not a field of a file upload: send only {', '.join(UPLOAD_FIELDS)} (check "
                            "its spelling, or remove it)", param=name)
    if name in seen:
        raise APIError(400, f"the field {name!r} is given twice; send each field once (one file per upload)",
                       param=name)
    seen.add(name)


def _storage_full(used: int, size: int, cap: int, partial: bool = False) -> APIError:
    """413 for a file that does not fit the tenant's storage cap (``partial``: ``size`` is what arrived so far)."""
    return APIError(413, f"this tenant's stored files take {used:,} bytes of its limit of {cap:,}, and this file "
                         f"({'at least ' if partial else ''}{size:,} bytes) does not fit; delete files it no "
                         "longer needs (DELETE /v1/files/{file_id}) or ask the operator to raise its "
                         "max_stored_file_bytes", param="file", code="storage_limit_exceeded")


async def upload(request: web.Request) -> web.Response:
    """``POST /v1/files``: admitted as a request (rate, concurrency), stored within the tenant's storage cap."""
    async with admitted(request):
        return await _store_upload(request)


async def _store_upload(request: web.Request) -> web.Response:
    tenant = request[PRINCIPAL].tenant
    data_dir, limit = request.app[DATA_DIR], request.app[MAX_FILE_BYTES]
    if not request.content_type.startswith("multipart/"):
        raise APIError(400, "upload a file as multipart/form-data with fields 'file' and 'purpose'")
    cap = (await request.app[QUOTAS].limits(tenant.id)).max_stored_file_bytes
    used = await request.app[BATCH_STORE].stored_bytes(tenant.id) if cap is not None else 0
    try:
        reader = await request.multipart()
    except (HttpProcessingError, ValueError, KeyError, AssertionError) as e:
        raise _malformed_multipart(e) from None
    purpose, filename, tmp, size = None, None, None, 0
    expiry: dict[str, str] = {}
    (data_dir / "files").mkdir(parents=True, exist_ok=True)  # the upload's temporary copy
    stall_s = request.app.get(BODY_TIMEOUT_S)

    async def progress(awaitable):
        """An upload may take long, but each part and chunk must arrive within the body timeout."""
        try:
            async with asyncio.timeout(stall_s):
                return await awaitable
        except (HttpProcessingError, ValueError, KeyError, AssertionError) as e:  # what aiohttp's parser raises
            raise _malformed_multipart(e) from None
        except web.RequestPayloadError as e:
            raise unreadable_body(e) from None
        except TimeoutError:
            raise stalled_body(request, f"the upload stalled: nothing arrived for {stall_s:g} s") from None

    seen: set[str] = set()
    try:
        while (part := await progress(reader.next())) is not None:
            _check_form_field(part, seen)
            if part.name == "purpose":
                purpose = await _read_field(part, "purpose", progress, request.client_max_size)
            elif part.name == "file":
                filename = _utf8_filename(part.filename or "upload.jsonl")
                fd, tmp = tempfile.mkstemp(dir=data_dir / "files", prefix=".upload-")
                with os.fdopen(fd, "wb") as out:
                    while chunk := await progress(part.read_chunk(_CHUNK)):
                        size += len(chunk)
                        if size > limit:
                            raise APIError(413, f"file is larger than the limit of {limit} bytes", param="file",
                                           code="file_too_large")
                        if cap is not None and used + size > cap:
                            raise _storage_full(used, size, cap, partial=True)
                        out.write(chunk)
            else:
                expiry[EXPIRY_PARTS[part.name]] = await _read_field(
                    part, f"expires_after.{EXPIRY_PARTS[part.name]}", progress, request.client_max_size)
        file_expiry(expiry or None, "expires_after", form=True)  # checked, not applied: files are kept until deleted
        if tmp is None:
            raise APIError(400, "missing the 'file' field", param="file")
        if purpose not in UPLOAD_PURPOSES:
            raise APIError(400, f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}, got {purpose!r}", param="purpose")
        # Into the database (row and content in one transaction): any gateway sharing it serves the file.
        try:
            info = await request.app[BATCH_STORE].add_file(tenant.id, filename, purpose, Path(tmp),
                                                           max_stored_bytes=cap)
        except StorageFull as full:  # other uploads of the tenant were stored meanwhile
            raise _storage_full(full.used, full.size, full.limit) from None
    except OSError as e:  # the data directory's disk is full or failing: nothing was stored
        raise APIError(503, f"the upload could not be stored ({e.strerror or e}); retry later", "server_error",
                       code="insufficient_storage", headers={"Retry-After": "30"}) from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return json_response(file_object(info))


def list_page(items: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


async def list_files(request: web.Request) -> web.Response:
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, "order must be 'asc' or 'desc'", param="order")
    files, more = await request.app[BATCH_STORE].list_files(
        request[PRINCIPAL].tenant.id, request.query.get("purpose"), request.query.get("after"),
        query_limit(request, default=10_000), newest_first=order == "desc")
    return json_response(list_page([file_object(f) for f in files], more))


async def _owned(request: web.Request) -> FileInfo:
    file_id = request.match_info["file_id"]
    info = await request.app[BATCH_STORE].get_file(request[PRINCIPAL].tenant.id, file_id)
    if info is None:
        raise _not_found(file_id)
    return info


async def get_file(request: web.Request) -> web.Response:
    return json_response(file_object(await _owned(request)))


async def file_content(request: web.Request) -> web.StreamResponse:
    info = await _owned(request)
    if info.path:  # written before contents moved into the database: on this gateway's disk
        path = file_path(request.app[DATA_DIR], info.path)
        if not path.exists():
            raise APIError(404, f"the content of file {info.id!r} is gone", code="file_not_found")
        return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    response.content_length = info.bytes
    await response.prepare(request)
    async for chunk in request.app[BATCH_STORE].file_chunks(info.id):
        await response.write(chunk)
    await response.write_eof()
    return response


async def read_content(app: web.Application, info: FileInfo) -> bytes:
    """A stored file's whole content (from the database, or the data directory for older files)."""
    if info.path:
        return await asyncio.to_thread(file_path(app[DATA_DIR], info.path).read_bytes)
    return await app[BATCH_STORE].read_file(info.id)


async def delete_file(request: web.Request) -> web.Response:
    file_id = request.match_info["file_id"]
    info = await request.app[BATCH_STORE].delete_file(request[PRINCIPAL].tenant.id, file_id)
    if info is None:
        raise _not_found(file_id)
    if info.path:  # an older file on disk (database contents go with the row)
        file_path(request.app[DATA_DIR], info.path).unlink(missing_ok=True)
    return json_response({"id": info.id, "object": "file", "deleted": True})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/files", upload)
    app.router.add_get("/v1/files", list_files)
    app.router.add_get("/v1/files/{file_id}", get_file)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_delete("/v1/files/{file_id}", delete_file)
