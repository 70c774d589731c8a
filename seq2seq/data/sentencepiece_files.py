"""SentencePiece models the user already has (`tokenizer.model_files`), made ready for seq2seq.

A vocabulary shared by several experiments, or one trained elsewhere, is used as it is, rather than
trained again. seq2seq keeps its special pieces at fixed ids (special_tokens.py: pad 0, unk 1, bos
2, eos 3), and most existing models keep them elsewhere (spm_train's defaults: unk 0, bos 1, eos 2,
no pad; fairseq's: bos 0, pad 1, eos 2, unk 3). The model's pieces are therefore put in another
order, the four special ones first (those it lacks added), every other piece after them in its own
order, with its score and type: the segmentation of any text, which SentencePiece finds from the
pieces' scores, is the same piece for piece; only the ids differ, which a model trained from
scratch on them never sees. The model is edited through its protobuf schema, which SentencePiece
ships (sentencepiece_model_pb2) and documents for this purpose.
"""

from __future__ import annotations

import logging
from pathlib import Path

import sentencepiece as spm

from seq2seq.config import TokenizerConfig
from seq2seq.data.special_tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from seq2seq.errors import UserInputError

log = logging.getLogger(__name__)

# Our id, the trainer_spec field that names the piece and its id, the name it has when unnamed.
SPECIAL_PIECES = ((PAD_ID, "pad", "<pad>"), (UNK_ID, "unk", "<unk>"), (BOS_ID, "bos", "<s>"), (EOS_ID, "eos", "</s>"))


def with_our_special_ids(proto: bytes, origin: str) -> bytes:
    """The model `proto` with its special pieces at seq2seq's ids and its other pieces after them.
    `origin` (the file) names the problem when it is not a usable SentencePiece model."""
    from google.protobuf.message import DecodeError
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    try:
        model.ParseFromString(proto)
    except DecodeError:
        raise UserInputError(f"{origin}: not a SentencePiece model (.model file from spm_train)") from None
    if not model.pieces:
        raise UserInputError(f"{origin}: not a SentencePiece model (.model file from spm_train): it holds no pieces")
    piece_type = sentencepiece_model_pb2.ModelProto.SentencePiece.Type
    spec, pieces = model.trainer_spec, list(model.pieces)
    specials, moved = {}, set()
    for our_id, name, default in SPECIAL_PIECES:
        their_id = getattr(spec, f"{name}_id")
        if 0 <= their_id < len(pieces):
            specials[our_id] = pieces[their_id]
            moved.add(their_id)
            continue
        if name == "unk":
            raise UserInputError(f"{origin}: a SentencePiece model without an unknown piece; expected one (unk_id)")
        piece_name = getattr(spec, f"{name}_piece") or default
        if any(piece.piece == piece_name for piece in pieces):
            raise UserInputError(
                f"{origin}: holds {piece_name!r} as an ordinary piece, the name of its missing {name} piece; "
                f"expected a model trained with {name}_id set, or without a piece of that name"
            )
        specials[our_id] = sentencepiece_model_pb2.ModelProto.SentencePiece(
            piece=piece_name, score=0.0, type=piece_type.CONTROL
        )
    del model.pieces[:]
    ordered = [specials[our_id] for our_id in sorted(specials)]  # ids 0 to 3
    model.pieces.extend(ordered + [piece for index, piece in enumerate(pieces) if index not in moved])
    spec.pad_id, spec.unk_id, spec.bos_id, spec.eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID
    edited = model.SerializeToString()
    try:  # a protobuf that parses is not yet a model SentencePiece loads (its unknown piece, its types)
        spm.SentencePieceProcessor(model_proto=edited)
    except (RuntimeError, OSError) as error:
        reason = str(error).split("] ", 1)[-1].strip() or type(error).__name__
        raise UserInputError(f"{origin}: not a SentencePiece model that loads ({reason})") from None
    return edited


def read_model_files(config: TokenizerConfig) -> list[bytes]:
    """The given model files, each ready for seq2seq, with every user-defined symbol (a corpus's tag)
    checked to be a piece of the source model that is never split."""
    protos = []
    for index, file in enumerate(config.model_files):
        key = f"tokenizer.model_files[{index}]"
        try:
            raw = Path(file).read_bytes()
        except OSError as error:
            raise UserInputError(f"{key}: {file}: cannot be read ({error.strerror or error})") from None
        protos.append(with_our_special_ids(raw, f"{key}: {file}"))
    never_split = _user_defined_pieces(protos[0])
    for symbol in config.user_defined_symbols:
        if symbol not in never_split:
            raise UserInputError(
                f"tokenizer.user_defined_symbols: {symbol!r} is not a user-defined piece of "
                f"{config.model_files[0]}, which may split it; expected a model trained with "
                f"--user_defined_symbols={symbol}"
            )
    log.info(
        "tokenizer: %s (%s pieces); tokenizer.vocab_size, model_type, character_coverage and sample_sentences "
        "are the file's own",
        " and ".join(config.model_files),
        " / ".join(str(spm.SentencePieceProcessor(model_proto=proto).get_piece_size()) for proto in protos),
    )
    return protos


def _user_defined_pieces(proto: bytes) -> set[str]:
    """The pieces SentencePiece never splits (user-defined symbols) of a model."""
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(proto)
    user_defined = sentencepiece_model_pb2.ModelProto.SentencePiece.Type.USER_DEFINED
    return {piece.piece for piece in model.pieces if piece.type == user_defined}
