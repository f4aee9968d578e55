"""Auto-paging iterators over cursor-paged list endpoints."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Generic, TypeVar

from ._base_client import RequestOptions
from ._models import Page

if TYPE_CHECKING:
    from ._base_client import AsyncRequester, SyncRequester

__all__ = ["Pager", "AsyncPager"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
PageRequest = Callable[[str | None], RequestOptions[Page[T]]]
#: Items per page the list methods ask for unless told otherwise.
DEFAULT_PAGE_SIZE = 50
"""Build the request for the page that starts at a cursor (None = the first page)."""


class _BasePager(Generic[T]):
    def __init__(self, page_request: PageRequest[T], cursor: str | None = None) -> None:
        self._page_request = page_request
        self._cursor = cursor

    @staticmethod
    def _next_cursor(page: Page[T], cursor: str | None) -> str | None:
        if not page.next:
            return None
        if page.next == cursor:
            # A gateway bug must not turn into an endless loop of identical requests.
            logger.warning("The gateway returned the same cursor %r twice; stopping iteration.", cursor)
            return None
        return page.next


class Pager(_BasePager[T]):
    """Iterate over every item of a list endpoint, fetching pages lazily as needed."""

    def __init__(self, client: SyncRequester, page_request: PageRequest[T], cursor: str | None = None) -> None:
        super().__init__(page_request, cursor)
        self._client = client

    def pages(self) -> Iterator[Page[T]]:
        """Yield each page in turn, starting from the first."""
        cursor = self._cursor
        while True:
            page = self._client._request(self._page_request(cursor))
            yield page
            cursor = self._next_cursor(page, cursor)
            if cursor is None:
                return

    def first_page(self) -> Page[T]:
        """Fetch only the first page (its `next` is the cursor to resume from)."""
        return self._client._request(self._page_request(self._cursor))

    def __iter__(self) -> Iterator[T]:
        for page in self.pages():
            yield from page.items


class AsyncPager(_BasePager[T]):
    """Iterate (`async for`) over every item of a list endpoint, fetching pages lazily."""

    def __init__(self, client: AsyncRequester, page_request: PageRequest[T], cursor: str | None = None) -> None:
        super().__init__(page_request, cursor)
        self._client = client

    async def pages(self) -> AsyncIterator[Page[T]]:
        """Yield each page in turn, starting from the first."""
        cursor = self._cursor
        while True:
            page = await self._client._request(self._page_request(cursor))
            yield page
            cursor = self._next_cursor(page, cursor)
            if cursor is None:
                return

    async def first_page(self) -> Page[T]:
        """Fetch only the first page (its `next` is the cursor to resume from)."""
        return await self._client._request(self._page_request(self._cursor))

    async def __aiter__(self) -> AsyncIterator[T]:
        async for page in self.pages():
            for item in page.items:
                yield item
