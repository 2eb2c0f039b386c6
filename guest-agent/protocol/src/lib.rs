//! Agent protocol.
