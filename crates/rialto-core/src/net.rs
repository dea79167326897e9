//! Sockets the processes listen on.

/// A listening TCP socket with `backlog` queued connections (the kernel's
/// `somaxconn` caps it). std's and Tokio's `TcpListener::bind` allow 128: a
/// burst of connections, such as 10,000 idle ones being opened again or 512
/// streams opening together, overflows it, and every client caught in the
/// burst, valid ones too, waits a second or more for its SYN retry.
pub fn listen(addr: std::net::SocketAddr, backlog: u32) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(i32::try_from(backlog).unwrap_or(i32::MAX))?;
    Ok(socket.into())
}

#[cfg(test)]
mod tests {
    /// The socket listens where it was bound and takes a connection.
    #[test]
    fn a_listener_takes_a_connection() {
        let listener = super::listen("127.0.0.1:0".parse().unwrap(), 4096).unwrap();
        let address = listener.local_addr().unwrap();
        assert_ne!(address.port(), 0);
        let client = std::net::TcpStream::connect(address).unwrap();
        let (accepted, from) = listener.accept().unwrap();
        assert_eq!(from, client.local_addr().unwrap());
        assert_eq!(accepted.local_addr().unwrap(), address);
    }
}
