"""The transport: :class:`Transport`, the two calls the producer makes of Kinesis, and the
implementation on aiobotocore (its clients, request bodies and the mapping of botocore's
errors to error codes, the only place they are seen).
"""
