#!/usr/bin/env python3
"""Writes a Megatron-LM indexed dataset (PREFIX.bin, PREFIX.idx) from a JSON list of documents.

An independent writer for the format test: it follows the format's description (the .idx header
"MMIDIDX\\x00\\x00", version 1 as a little-endian u64, the token type's code as a u8, the sequence
count and the document index's length as u64, then the int32 sequence lengths, the int64 byte
pointers of the sequences in .bin and the int64 document index), using the standard library only.
Each non-empty document is one sequence; an empty one adds a document of no sequence.

usage: write_indexed_dataset.py DOCUMENTS.json TYPE_CODE PREFIX
"""
import json
import struct
import sys

# struct formats and sizes of the integer token types by their code
TOKEN_FORMATS = {1: "B", 2: "b", 3: "h", 4: "i", 5: "q", 8: "H"}


def main():
    documents_path, code, prefix = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with open(documents_path) as f:
        documents = json.load(f)
    token = TOKEN_FORMATS[code]
    size = struct.calcsize("<" + token)
    lengths, pointers, document_index = [], [], [0]
    position = 0
    with open(prefix + ".bin", "wb") as data:
        for document in documents:
            if document:
                data.write(struct.pack("<%d%s" % (len(document), token), *document))
                lengths.append(len(document))
                pointers.append(position)
                position += len(document) * size
            document_index.append(len(lengths))
    with open(prefix + ".idx", "wb") as index:
        index.write(b"MMIDIDX\x00\x00")
        index.write(struct.pack("<QBQQ", 1, code, len(lengths), len(document_index)))
        index.write(struct.pack("<%di" % len(lengths), *lengths))
        index.write(struct.pack("<%dq" % len(pointers), *pointers))
        index.write(struct.pack("<%dq" % len(document_index), *document_index))


if __name__ == "__main__":
    main()
