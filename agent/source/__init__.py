"""Everything that speaks S3: listing, HEAD and checksums, ranged GETs, data planes,
small objects for compile caches. The only package that imports the S3 libraries."""
