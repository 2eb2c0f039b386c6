//! microvm host side.
